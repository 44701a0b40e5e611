"""Random-weight bf16 HF checkpoints of real model shapes, for speed and memory benchmarks only.

usage: .venv-fixtures/bin/python scripts/bench_mlx_make.py SHAPE OUT_DIR
  SHAPE: qwen2.5-0.5b (qwen2: hidden 896, 24 layers, 14/2 heads, ffn 4864, vocab 151936, tied)
         smollm2-135m (llama: hidden 576, 30 layers, 9/3 heads, ffn 1536, vocab 49152, tied)
         gemma3-270m  (gemma3_text: hidden 640, 18 layers, 4/1 heads of 256, ffn 2048,
                       vocab 262144, tied, 5 sliding (512) : 1 global)
         qwen3-30b-a3b-8l (qwen3_moe: Qwen3-30B-A3B's layer shapes cut to 8 of its 48 layers:
                       hidden 2048, 32/4 heads of 128, 128 experts of 768, top 8, vocab 151936)
         qwen3-30b-a3b-stream (the same layers, 10 of them, and the fixtures' 512-token
                       vocabulary: 6.0 B parameters, 3.4 GB of experts at 4 bits, while what
                       stays resident under --stream-experts is small; for the streaming runs)

Weights come from transformers' own initialisation (seeded), stored bf16. The tokenizer is the
repository's llama fixture tokenizer (byte-level BPE, 512 tokens) with its vocabulary padded by
unreachable tokens up to the model's vocabulary, so every id a random model emits decodes. Outputs
are meaningless text; only speed and memory are measured. Nothing here is committed.
"""
import json, os, shutil, sys
os.environ.setdefault("HF_HUB_OFFLINE", "1")
import torch, transformers

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
FIXTURE = os.path.join(ROOT, "tests", "fixtures", "llama", "hf")
SEED = 20261129


def qwen3_30b_a3b(layers, vocab_size):
    """Qwen3-30B-A3B's layer shapes, `layers` of its 48."""
    return transformers.Qwen3MoeConfig(
        hidden_size=2048, num_hidden_layers=layers, num_attention_heads=32, num_key_value_heads=4,
        head_dim=128, intermediate_size=6144, moe_intermediate_size=768, num_experts=128,
        num_experts_per_tok=8, norm_topk_prob=True, decoder_sparse_step=1, mlp_only_layers=[],
        vocab_size=vocab_size, tie_word_embeddings=False, max_position_embeddings=40960,
        rope_theta=1000000.0, rms_norm_eps=1e-6, bos_token_id=None, eos_token_id=2,
        pad_token_id=0)


SHAPES = {
    "qwen2.5-0.5b": lambda: transformers.Qwen2Config(
        hidden_size=896, num_hidden_layers=24, num_attention_heads=14, num_key_value_heads=2,
        intermediate_size=4864, vocab_size=151936, tie_word_embeddings=True,
        max_position_embeddings=32768, rope_theta=1000000.0, rms_norm_eps=1e-6,
        use_sliding_window=False, bos_token_id=None, eos_token_id=2, pad_token_id=0),
    "smollm2-135m": lambda: transformers.LlamaConfig(
        hidden_size=576, num_hidden_layers=30, num_attention_heads=9, num_key_value_heads=3,
        intermediate_size=1536, vocab_size=49152, tie_word_embeddings=True,
        max_position_embeddings=8192, rope_theta=100000.0, rms_norm_eps=1e-5,
        bos_token_id=None, eos_token_id=2, pad_token_id=0),
    "gemma3-270m": lambda: transformers.Gemma3TextConfig(
        hidden_size=640, num_hidden_layers=18, num_attention_heads=4, num_key_value_heads=1,
        head_dim=256, intermediate_size=2048, vocab_size=262144, tie_word_embeddings=True,
        max_position_embeddings=32768, sliding_window=512, query_pre_attn_scalar=256,
        rms_norm_eps=1e-6, bos_token_id=None, eos_token_id=2, pad_token_id=0),
    "qwen3-30b-a3b-8l": lambda: qwen3_30b_a3b(layers=8, vocab_size=151936),
    "qwen3-30b-a3b-stream": lambda: qwen3_30b_a3b(layers=10, vocab_size=512),
}


def padded_tokenizer(vocab_size, out):
    tok = json.load(open(os.path.join(FIXTURE, "tokenizer.json")))
    vocab = tok["model"]["vocab"]
    taken = set(vocab.values()) | {a["id"] for a in tok["added_tokens"]}
    for i in range(vocab_size):
        if i not in taken:
            vocab[f"<bench{i}>"] = i
    json.dump(tok, open(os.path.join(out, "tokenizer.json"), "w"), ensure_ascii=False)
    shutil.copy(os.path.join(FIXTURE, "tokenizer_config.json"), out)


def main():
    shape, out = sys.argv[1], sys.argv[2]
    config = SHAPES[shape]()
    torch.manual_seed(SEED)
    model = transformers.AutoModelForCausalLM.from_config(config, dtype=torch.bfloat16)
    os.makedirs(out, exist_ok=True)
    model.save_pretrained(out, safe_serialization=True, max_shard_size="20GB")
    padded_tokenizer(config.vocab_size, out)
    n = sum(p.numel() for p in model.parameters())
    print(f"{shape}: {n / 1e6:.1f}M parameters -> {out}", file=sys.stderr)


if __name__ == "__main__":
    main()
