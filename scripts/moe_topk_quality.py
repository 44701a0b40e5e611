"""What `--moe-top-k` costs: next-token distributions with a lowered top-k against the model's own,
over every position of a fixed token sequence (`peregrine logits`, f32 KV). Prints one JSON line
per k: top-1 agreement and mean KL(own || lowered).

usage: python3 scripts/moe_topk_quality.py --model M --ks 6,4,2 [--tokens 128] [--peregrine BIN]
The sequence is token ids 3.. of a fixed pseudo-random walk over the vocabulary (no tokenizer
needed: random-weight models have no text to prefer)."""
import argparse, json, os, subprocess, tempfile
import numpy as np
from safetensors.numpy import load_file

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def logits(a, ids, k):
    with tempfile.TemporaryDirectory() as tmp:
        out = os.path.join(tmp, "l.safetensors")
        cmd = [a.peregrine, "--threads", "2", "logits", "--model", a.model, "--input-ids",
               ",".join(map(str, ids)), "--out", out] + (["--moe-top-k", str(k)] if k else [])
        subprocess.run(cmd, check=True, capture_output=True)
        return load_file(out)["logits"].astype(np.float64)


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--model", required=True)
    ap.add_argument("--ks", required=True)
    ap.add_argument("--tokens", type=int, default=128)
    ap.add_argument("--vocab", type=int, default=512, help="ids are drawn below this")
    ap.add_argument("--peregrine", default=os.path.join(ROOT, "target", "release", "peregrine"))
    a = ap.parse_args()
    rng = np.random.default_rng(20261204)
    ids = [int(i) for i in rng.integers(3, a.vocab, a.tokens)]
    own = logits(a, ids, None)
    p = np.exp(own - own.max(-1, keepdims=True))
    p /= p.sum(-1, keepdims=True)
    for k in map(int, a.ks.split(",")):
        low = logits(a, ids, k)
        q = np.exp(low - low.max(-1, keepdims=True))
        q /= q.sum(-1, keepdims=True)
        kl = float(np.mean(np.sum(p * (np.log(p + 1e-30) - np.log(q + 1e-30)), -1)))
        top1 = float(np.mean(own.argmax(-1) == low.argmax(-1)))
        print(json.dumps({"model": a.model, "top_k": k, "positions": len(ids), "top1_agreement": top1,
                          "mean_kl": kl}), flush=True)


if __name__ == "__main__":
    main()
