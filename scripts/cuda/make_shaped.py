#!/usr/bin/env python3
"""A random-weight checkpoint of a real model's shape, made where it will run (a GPU machine:
multi-GB weights cannot be carried there), for speed runs.

usage: make_shaped.py OUT [--shape llama-3.1-8b|qwen3-30b-a3b] [--layers N] [--vocab N]
Writes bf16 safetensors (in shards of at most 4 GiB), config.json and a byte-level BPE tokenizer
of the model's full vocabulary (the 256 bytes, then fillers `w256` ... `wN`), so the output head
costs what the real one costs (`--vocab` cuts it, for runs that measure the layers alone).
Weights: Gaussian, std 0.02 (norm weights 1), drawn on the GPU when torch and one are there,
else by numpy (a CPU host without torch: about a minute a billion weights on one core).
Convert afterwards with `peregrine quantize` (MLX 4-bit, GGUF blocks).
"""
import argparse
import json
import math
import struct
from pathlib import Path

try:
    import torch
    from safetensors.torch import save_file
except ImportError:
    torch = None
    import numpy as np

SHAPES = {
    "llama-3.1-8b": dict(
        architectures=["LlamaForCausalLM"], model_type="llama", hidden_size=4096,
        intermediate_size=14336, num_hidden_layers=32, num_attention_heads=32,
        num_key_value_heads=8, head_dim=128, vocab_size=128256, rms_norm_eps=1e-5,
        rope_theta=500000.0, max_position_embeddings=131072, tie_word_embeddings=False,
        rope_scaling=dict(rope_type="llama3", factor=8.0, low_freq_factor=1.0,
                          high_freq_factor=4.0, original_max_position_embeddings=8192)),
    "qwen3-30b-a3b": dict(
        architectures=["Qwen3MoeForCausalLM"], model_type="qwen3_moe", hidden_size=2048,
        intermediate_size=6144, moe_intermediate_size=768, num_hidden_layers=48,
        num_attention_heads=32, num_key_value_heads=4, head_dim=128, vocab_size=151936,
        num_experts=128, num_experts_per_tok=8, norm_topk_prob=True, decoder_sparse_step=1,
        mlp_only_layers=[], rms_norm_eps=1e-6, rope_theta=1000000.0,
        max_position_embeddings=40960, tie_word_embeddings=False),
}


def tensors(c):
    h, hd, v = c["hidden_size"], c["head_dim"], c["vocab_size"]
    q, kv = c["num_attention_heads"] * hd, c["num_key_value_heads"] * hd
    yield "model.embed_tokens.weight", (v, h)
    for i in range(c["num_hidden_layers"]):
        p = f"model.layers.{i}."
        yield p + "input_layernorm.weight", (h,)
        yield p + "post_attention_layernorm.weight", (h,)
        for name, shape in [("q", (q, h)), ("k", (kv, h)), ("v", (kv, h)), ("o", (h, q))]:
            yield f"{p}self_attn.{name}_proj.weight", shape
        if c["model_type"] == "qwen3_moe":
            yield p + "self_attn.q_norm.weight", (hd,)
            yield p + "self_attn.k_norm.weight", (hd,)
            m = c["moe_intermediate_size"]
            yield p + "mlp.gate.weight", (c["num_experts"], h)
            for e in range(c["num_experts"]):
                yield from mlp(f"{p}mlp.experts.{e}.", h, m)
        else:
            yield from mlp(p + "mlp.", h, c["intermediate_size"])
    yield "model.norm.weight", (h,)
    yield "lm_head.weight", (v, h)


def mlp(p, h, m):
    yield p + "gate_proj.weight", (m, h)
    yield p + "up_proj.weight", (m, h)
    yield p + "down_proj.weight", (h, m)


def byte_alphabet():
    """GPT-2's printable stand-ins for the 256 bytes (bytes_to_unicode)."""
    keep = list(range(ord("!"), ord("~") + 1)) + list(range(ord("¡"), ord("¬") + 1)) + \
        list(range(ord("®"), ord("ÿ") + 1))
    out, n = {}, 0
    for b in range(256):
        if b in keep:
            out[b] = chr(b)
        else:
            out[b] = chr(256 + n)
            n += 1
    return [out[b] for b in range(256)]


def tokenizer(vocab):
    """A byte-level BPE without merges (so `peregrine quantize --format gguf` can write it): the
    256 byte symbols, then `w256` ... filler tokens up to the model's vocabulary."""
    words = {c: i for i, c in enumerate(byte_alphabet())}
    words.update({f"w{i}": i for i in range(256, vocab)})
    special = [{"id": i, "content": f"w{i}", "single_word": False, "lstrip": False,
                "rstrip": False, "normalized": False, "special": True} for i in (vocab - 2, vocab - 1)]
    byte_level = {"type": "ByteLevel", "add_prefix_space": False, "trim_offsets": True, "use_regex": True}
    return {"version": "1.0", "truncation": None, "padding": None, "added_tokens": special,
            "normalizer": None, "pre_tokenizer": byte_level, "post_processor": None,
            "decoder": byte_level,
            "model": {"type": "BPE", "dropout": None, "unk_token": None, "continuing_subword_prefix": None,
                      "end_of_word_suffix": None, "fuse_unk": False, "byte_fallback": False,
                      "ignore_merges": False, "vocab": words, "merges": []}}


def gaussian_bf16():
    """shape -> bf16 weights: torch tensors, or numpy uint16 bit patterns without torch."""
    if torch:
        dev = "cuda" if torch.cuda.is_available() else "cpu"
        gen = torch.Generator(device=dev).manual_seed(0)
        return lambda shape: torch.ones(shape, dtype=torch.bfloat16) if len(shape) == 1 else \
            (torch.randn(shape, generator=gen, device=dev) * 0.02).to(torch.bfloat16).cpu()
    rng = np.random.default_rng(0)

    def draw(shape):
        if len(shape) == 1:
            return np.full(shape, 0x3F80, np.uint16)  # bf16 1.0
        bits = (rng.standard_normal(shape, np.float32) * np.float32(0.02)).view(np.uint32)
        return ((bits + 0x7FFF + ((bits >> 16) & 1)) >> 16).astype(np.uint16)  # round to even
    return draw


def save_bf16(shard, path):
    """safetensors of numpy bf16 bit patterns (the format: a JSON header, then the bytes)."""
    header, at = {"__metadata__": {"format": "pt"}}, 0
    for name, t in shard.items():
        header[name] = {"dtype": "BF16", "shape": list(t.shape), "data_offsets": [at, at + t.nbytes]}
        at += t.nbytes
    head = json.dumps(header).encode()
    head += b" " * (-len(head) % 8)
    with open(path, "wb") as f:
        f.write(struct.pack("<Q", len(head)) + head)
        for t in shard.values():
            f.write(t.tobytes())


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("out")
    ap.add_argument("--shape", choices=SHAPES, default="llama-3.1-8b")
    ap.add_argument("--layers", type=int, help="fewer layers than the model's (a quicker run)")
    ap.add_argument("--vocab", type=int, help="a smaller vocabulary than the model's")
    a = ap.parse_args()
    v = a.vocab or SHAPES[a.shape]["vocab_size"]
    c = dict(SHAPES[a.shape], torch_dtype="bfloat16", vocab_size=v, bos_token_id=v - 2,
             eos_token_id=v - 1)
    if a.layers:
        c["num_hidden_layers"] = a.layers
    out = Path(a.out)
    out.mkdir(parents=True, exist_ok=True)
    draw = gaussian_bf16()
    shard, size, index, n = {}, 0, {}, 0

    def flush():
        nonlocal shard, size, n
        name = f"model-{n:05d}.safetensors"
        if torch:
            save_file(shard, str(out / name), metadata={"format": "pt"})
        else:
            save_bf16(shard, out / name)
        index.update({k: name for k in shard})
        shard, size, n = {}, 0, n + 1

    for name, shape in tensors(c):
        shard[name] = draw(shape)
        size += 2 * math.prod(shape)
        if size >= 4 << 30:
            flush()
    if shard:
        flush()
    (out / "model.safetensors.index.json").write_text(
        json.dumps({"metadata": {}, "weight_map": index}))
    (out / "config.json").write_text(json.dumps(c, indent=1))
    (out / "tokenizer.json").write_text(json.dumps(tokenizer(c["vocab_size"])))
    (out / "tokenizer_config.json").write_text(json.dumps(
        {"bos_token": f"w{v - 2}", "eos_token": f"w{v - 1}", "add_bos_token": True}))
    print(f"wrote {out}: {a.shape}, {c['num_hidden_layers']} layers, {n} shards")


if __name__ == "__main__":
    main()
