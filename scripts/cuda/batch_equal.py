#!/usr/bin/env python3
"""Greedy text of N concurrent requests through `peregrine serve`, with an environment variable
off and then on (default PEREGRINE_CUDA_BATCH_ATTN, the batched decode attention): prints, per
request, whether the two texts are equal and, where not, the character they part at. A change
that only reorders float sums may part late on a random model's near-even logits; one that
attends the wrong cache parts at once.

usage: scripts/cuda/batch_equal.py --model M [--peregrine BIN] [--device cuda] [--streams 16]
           [--gen-tokens 32] [--var PEREGRINE_CUDA_BATCH_ATTN]
Standard library only; loopback.
"""
import argparse
import http.client
import json
import os
import subprocess
import sys
import threading
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
from bench_batching import free_port, wait_ready  # noqa: E402


def complete(port, i, gen_tokens, out):
    # Prompts of different lengths, so the sequences sit at different positions.
    text = f"Request {i}: " + " ".join(["river stone lantern"] * (1 + 3 * i))
    body = json.dumps({"prompt": text, "max_tokens": gen_tokens, "temperature": 0,
                       "ignore_eos": True})
    c = http.client.HTTPConnection("127.0.0.1", port, timeout=600)
    c.request("POST", "/v1/completions", body, {"Content-Type": "application/json"})
    r = c.getresponse()
    reply = json.loads(r.read())
    out[i] = reply["choices"][0]["text"] if r.status == 200 else f"HTTP {r.status}: {reply}"


def texts(a, value):
    port = free_port()
    env = dict(os.environ, **{a.var: value})
    cmd = [a.peregrine, "serve", "--model", a.model, "--port", str(port), "--parallel",
           str(a.streams), "--prompt-cache-entries", "0", "--device", a.device]
    proc = subprocess.Popen(cmd, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    try:
        wait_ready(port, proc)
        out = [None] * a.streams
        threads = [threading.Thread(target=complete, args=(port, i, a.gen_tokens, out))
                   for i in range(a.streams)]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
        return out
    finally:
        proc.terminate()
        proc.wait(timeout=30)


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--model", required=True)
    ap.add_argument("--peregrine", default="peregrine")
    ap.add_argument("--device", default="cuda")
    ap.add_argument("--streams", type=int, default=16)
    ap.add_argument("--gen-tokens", type=int, default=32)
    ap.add_argument("--var", default="PEREGRINE_CUDA_BATCH_ATTN")
    a = ap.parse_args()
    off, on = texts(a, "0"), texts(a, "1")
    same = 0
    for i, (x, y) in enumerate(zip(off, on)):
        if x == y:
            same += 1
            continue
        at = next((j for j, (p, q) in enumerate(zip(x, y)) if p != q), min(len(x), len(y)))
        print(f"request {i}: parts at character {at}: {x[:at + 20]!r} / {y[:at + 20]!r}")
    print(json.dumps({"requests": a.streams, "equal": same, "var": a.var}))
    sys.exit(0 if same == a.streams else 1)


if __name__ == "__main__":
    main()
