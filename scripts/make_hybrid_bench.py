"""A random-weight Qwen3-Next checkpoint of real layer shapes and few layers, for speed runs.

usage: .venv-fixtures/bin/python scripts/make_hybrid_bench.py OUT [--layers 4] [--experts 16]

Qwen3-Next-80B-A3B's shapes: hidden 2048; full attention of 16 query heads and 2 KV heads of
256 (gated, a quarter rotary); gated delta-net of 16 key heads and 32 value heads of 128, conv
4; every fourth layer full attention; MoE of 512-wide experts, 10 per token, plus a 512-wide
gated shared expert. Only the expert count (512 in the real model) and the vocabulary (the
fixtures' 512-token tokenizer) are cut, so a decode step costs what the real model's layers cost
per layer, less the head. Writes bf16 safetensors, config.json and the tokenizer files; then
`peregrine quantize --model OUT --out OUT-mlx4` makes the 4-bit MLX copy the benchmark runs.
"""
import argparse, os, shutil, sys
os.environ.setdefault("HF_HUB_OFFLINE", "1")
import torch, transformers

ap = argparse.ArgumentParser()
ap.add_argument("out")
ap.add_argument("--layers", type=int, default=4)
ap.add_argument("--experts", type=int, default=16)
a = ap.parse_args()
cfg = transformers.Qwen3NextConfig(
    vocab_size=512, hidden_size=2048, intermediate_size=5120, num_hidden_layers=a.layers,
    num_attention_heads=16, num_key_value_heads=2, head_dim=256, linear_num_key_heads=16,
    linear_num_value_heads=32, linear_key_head_dim=128, linear_value_head_dim=128,
    linear_conv_kernel_dim=4, layer_types=[("full_attention" if (i + 1) % 4 == 0 else "linear_attention")
                                           for i in range(a.layers)],
    num_experts=a.experts, num_experts_per_tok=min(10, a.experts), moe_intermediate_size=512,
    shared_expert_intermediate_size=512, decoder_sparse_step=1, mlp_only_layers=[],
    norm_topk_prob=True, tie_word_embeddings=False, max_position_embeddings=4096,
    rope_parameters=dict(rope_type="default", rope_theta=10000000.0, partial_rotary_factor=0.25),
    bos_token_id=None, eos_token_id=2, pad_token_id=0)
torch.manual_seed(0)
model = transformers.Qwen3NextForCausalLM._from_config(cfg, dtype=torch.bfloat16)
model.save_pretrained(a.out, safe_serialization=True)
fixture = os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "tests", "fixtures", "qwen3_next", "hf")
for f in ("tokenizer.json", "tokenizer_config.json"):
    shutil.copy(os.path.join(fixture, f), os.path.join(a.out, f))
n = sum(p.numel() for p in model.parameters())
print(f"wrote {a.out}: {a.layers} layers, {n / 1e6:.0f}M parameters", file=sys.stderr)
