#!/usr/bin/env python3
"""A random-weight llama checkpoint with Llama-3.1-8B's attention shape, for KV-size benchmarks.

hidden 4096, 32 query heads and 8 KV heads of 128, RoPE theta 500000, a 40,960-position
context; the MLP is cut to 128 wide and the vocabulary is the test fixture's 512 tokens (the KV
cache does not depend on either), so a 32K prefill costs attention, not a whole 8B model.
Weights: f32, a block of Gaussian values (std 0.02) repeated; plain Python, no numpy.

usage: scripts/make_attention_bench.py OUT_DIR [--layers N]   (default 1 layer)
then:  peregrine --threads 2 bench --model OUT_DIR --prompt-tokens 32000 --gen-tokens 4 \
           --repeat 1 --warmup 0 [--cache-type f32 | --kv-bits 8 | --kv-bits 4 | --turbo-kv]
bench's kv_bytes are the cache's allocations for N layers; Llama-3.1-8B has 32.
"""
import argparse
import array
import json
import random
import shutil
import struct
from pathlib import Path

HIDDEN, HEADS, KV_HEADS, HEAD_DIM, MLP, VOCAB = 4096, 32, 8, 128, 128, 512


def tensors(layers):
    yield "model.embed_tokens.weight", (VOCAB, HIDDEN)
    for i in range(layers):
        p = f"model.layers.{i}."
        yield p + "input_layernorm.weight", (HIDDEN,)
        yield p + "post_attention_layernorm.weight", (HIDDEN,)
        yield p + "self_attn.q_proj.weight", (HEADS * HEAD_DIM, HIDDEN)
        yield p + "self_attn.k_proj.weight", (KV_HEADS * HEAD_DIM, HIDDEN)
        yield p + "self_attn.v_proj.weight", (KV_HEADS * HEAD_DIM, HIDDEN)
        yield p + "self_attn.o_proj.weight", (HIDDEN, HEADS * HEAD_DIM)
        yield p + "mlp.gate_proj.weight", (MLP, HIDDEN)
        yield p + "mlp.up_proj.weight", (MLP, HIDDEN)
        yield p + "mlp.down_proj.weight", (HIDDEN, MLP)
    yield "model.norm.weight", (HIDDEN,)
    yield "lm_head.weight", (VOCAB, HIDDEN)


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("out")
    ap.add_argument("--layers", type=int, default=1)
    a = ap.parse_args()
    out = Path(a.out)
    out.mkdir(parents=True, exist_ok=True)
    rng = random.Random(0)
    block = array.array("f", (rng.gauss(0.0, 0.02) for _ in range(1 << 20))).tobytes()
    ones = array.array("f", [1.0] * HIDDEN).tobytes()
    header, offset, specs = {}, 0, list(tensors(a.layers))
    for name, shape in specs:
        n = 4
        for d in shape:
            n *= d
        header[name] = {"dtype": "F32", "shape": list(shape), "data_offsets": [offset, offset + n]}
        offset += n
    head = json.dumps(header).encode()
    head += b" " * (-len(head) % 8)
    with open(out / "model.safetensors", "wb") as f:
        f.write(struct.pack("<Q", len(head)))
        f.write(head)
        for name, shape in specs:
            n = header[name]["data_offsets"][1] - header[name]["data_offsets"][0]
            if len(shape) == 1:
                f.write(ones)
                continue
            while n > 0:
                f.write(block[: min(n, len(block))])
                n -= len(block)
    config = {
        "architectures": ["LlamaForCausalLM"], "model_type": "llama", "hidden_size": HIDDEN,
        "intermediate_size": MLP, "num_hidden_layers": a.layers, "num_attention_heads": HEADS,
        "num_key_value_heads": KV_HEADS, "head_dim": HEAD_DIM, "hidden_act": "silu",
        "max_position_embeddings": 40960, "rms_norm_eps": 1e-5, "rope_theta": 500000.0,
        "tie_word_embeddings": False, "vocab_size": VOCAB, "bos_token_id": None,
        "eos_token_id": 2, "torch_dtype": "float32",
    }
    (out / "config.json").write_text(json.dumps(config, indent=2))
    fixture = Path(__file__).resolve().parent.parent / "tests/fixtures/llama/hf"
    for name in ["tokenizer.json", "tokenizer_config.json"]:
        shutil.copy(fixture / name, out / name)
    print(f"wrote {out}: {a.layers} layer(s), {offset / 1e6:.0f} MB of weights")


if __name__ == "__main__":
    main()
