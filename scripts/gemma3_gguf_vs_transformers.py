"""How far apart can correct implementations of a Q4 Gemma 3 be? Runs transformers (f32, eager) on the
dequantized weights of the Gemma 3 270M GGUF over llama.cpp's recorded cases (tests/data/llamacpp/gemma3.json)
and prints its teacher-forced top-1 agreement with llama.cpp and the top-5 logit differences: the noise
floor that the Gemma 3 test in tests/integration/real_models.rs is calibrated against.

usage: PYTHONPATH=<dir with the `gguf` package> .venv-fixtures/bin/python scripts/gemma3_gguf_vs_transformers.py \
           [--model ~/.cache/peregrine/models/gemma-3-270m-q4_k_m.gguf] [--out top5.json]
Measured (transformers 5.24, gguf 0.19): 186/192, top-5 logit |diff| mean 0.22, max 1.31.
--out writes the same schema as the llama.cpp file (top1/top5 replaced), to test against transformers."""
import argparse, json, os, sys
import numpy as np, torch, transformers
from gguf import GGUFReader
from gguf.quants import dequantize

ROOT = os.path.join(os.path.dirname(os.path.abspath(__file__)), "..")
NAMES = {"attn_norm": "input_layernorm", "post_attention_norm": "post_attention_layernorm",
         "ffn_norm": "pre_feedforward_layernorm", "post_ffw_norm": "post_feedforward_layernorm",
         "attn_q": "self_attn.q_proj", "attn_k": "self_attn.k_proj", "attn_v": "self_attn.v_proj",
         "attn_output": "self_attn.o_proj", "attn_q_norm": "self_attn.q_norm",
         "attn_k_norm": "self_attn.k_norm", "ffn_gate": "mlp.gate_proj", "ffn_up": "mlp.up_proj",
         "ffn_down": "mlp.down_proj"}

def state_dict(reader):
    sd = {}
    for t in reader.tensors:
        a = dequantize(t.data, t.tensor_type).astype(np.float32).reshape([int(x) for x in reversed(t.shape)])
        if t.name == "token_embd.weight":
            hf = "model.embed_tokens.weight"
        elif t.name == "output_norm.weight":
            hf = "model.norm.weight"
        else:
            _, layer, module, kind = t.name.split(".")
            hf = f"model.layers.{layer}.{NAMES[module]}.{kind}"
        if hf.endswith("norm.weight"):
            a = a - 1.0  # llama.cpp's converter stores 1 + w; transformers adds the 1 itself
        sd[hf] = torch.from_numpy(np.ascontiguousarray(a))
    return sd

def config(reader):
    kv = lambda k: reader.fields[f"gemma3.{k}"].contents()
    n = kv("block_count")
    return transformers.Gemma3TextConfig(
        vocab_size=len(reader.fields["tokenizer.ggml.tokens"].data), hidden_size=kv("embedding_length"),
        intermediate_size=kv("feed_forward_length"), num_hidden_layers=n,
        num_attention_heads=kv("attention.head_count"), num_key_value_heads=kv("attention.head_count_kv"),
        head_dim=kv("attention.key_length"), query_pre_attn_scalar=kv("attention.key_length"),
        sliding_window=kv("attention.sliding_window"), rms_norm_eps=kv("attention.layer_norm_rms_epsilon"),
        max_position_embeddings=kv("context_length"), tie_word_embeddings=True,
        layer_types=["full_attention" if (i + 1) % 6 == 0 else "sliding_attention" for i in range(n)],
        rope_parameters={"full_attention": {"rope_type": "default", "rope_theta": kv("rope.freq_base")},
                         "sliding_attention": {"rope_type": "default", "rope_theta": 10000.0}},
        attn_implementation="eager")

def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--model", default=os.path.expanduser("~/.cache/peregrine/models/gemma-3-270m-q4_k_m.gguf"))
    ap.add_argument("--out")
    a = ap.parse_args()
    reader = GGUFReader(a.model)
    model = transformers.Gemma3ForCausalLM(config(reader)).float().eval()
    missing, unexpected = model.load_state_dict(state_dict(reader), strict=False)
    assert missing == ["lm_head.weight"] and not unexpected, (missing, unexpected)  # lm_head is tied
    ref = json.load(open(os.path.join(ROOT, "tests/data/llamacpp/gemma3.json")))
    agree = total = 0
    diffs = []
    with torch.no_grad():
        for case in ref["cases"]:
            ids = case["prompt_ids"] + case["continuation_ids"]
            logits = model(torch.tensor([ids]), use_cache=False).logits[0]
            top5 = torch.topk(logits, 5, dim=-1)
            for pos in range(len(case["prompt_ids"]) - 1, len(ids) - 1):
                total += 1
                agree += int(top5.indices[pos, 0]) == case["top1"][pos]
                diffs += [abs(float(logits[pos, i]) - v) for i, v in case["top5"][pos]]
            case["top5"] = [[[int(i), round(float(v), 4)] for i, v in zip(ti, tv)]
                            for ti, tv in zip(top5.indices, top5.values)]
            case["top1"] = [t[0][0] for t in case["top5"]]
    print(f"transformers f32 on dequantized weights vs llama.cpp: top-1 {agree}/{total}; "
          f"top-5 logit |diff| mean {np.mean(diffs):.3f} max {np.max(diffs):.3f}")
    if a.out:
        json.dump(ref, open(a.out, "w"))

if __name__ == "__main__":
    main()
