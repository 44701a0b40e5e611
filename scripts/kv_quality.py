"""KV cache precision against f32 on real text: for each KV mode, `peregrine logits` over one
long English prompt, compared with the f32 cache's logits at the positions past `--from`: top-1
agreement and the mean KL divergence KL(p_f32 || p_mode) of the next-token distributions.

usage: .venv-ref/bin/python scripts/kv_quality.py --model M [--text FILE ...] [--chars 16000] [--from 2048]
       [--positions 200] [--windows W] [--modes f16,bf16,q8,q4,turbo] [--kv-group-size 64] [--turbo-hot-window 256]
       [--turbo-keys mse|qjl]
       [--peregrine target/release/peregrine] [--threads 2]

Modes: f32/f16/bf16 (`--cache-type`), q8/q4 (`--kv-bits 8|4`, in groups of `--kv-group-size`), turbo (`--turbo-kv`,
its default 256-token hot window and 2,048-token threshold: positions past `--from` 2048 read
compressed keys; `--turbo-keys` picks its key codes).

The default text is tests/data/kv_quality/prompt.txt (the repository's own English prose, pinned:
see the README there), its first 16,000 characters (about 4K tokens), tokenized by the model; it
must reach `from + positions` tokens.
Prints one JSON line per mode; `--windows W` adds the figures of each W consecutive positions
(top-1 over 200 positions moves by 0.005 a flip, and near-ties flip with any change of rounding)."""
import argparse, json, os, subprocess, sys, tempfile

import numpy as np
from safetensors.numpy import load_file

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def kv_args(a, mode):
    group = ["--kv-group-size", str(a.kv_group_size)]
    turbo = ["--turbo-kv", "--turbo-hot-window", str(a.turbo_hot_window), "--turbo-keys", a.turbo_keys]
    modes = {"q8": ["--kv-bits", "8", *group], "q4": ["--kv-bits", "4", *group], "turbo": turbo}
    return modes.get(mode, ["--cache-type", mode])


def logits(a, text_file, mode, out):
    kv = kv_args(a, mode)
    subprocess.run([a.peregrine, "--threads", str(a.threads), "logits", "--model", a.model,
                    *kv, "--prompt-file", text_file,
                    "--positions", f"{a.start}..{a.start + a.positions}", "--out", out],
                   check=True, stderr=subprocess.DEVNULL)
    return load_file(out)


def log_softmax(x):
    x = x.astype(np.float64)
    x = x - x.max(axis=-1, keepdims=True)
    return x - np.log(np.exp(x).sum(axis=-1, keepdims=True))


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--model", required=True)
    ap.add_argument("--text", nargs="*",
                    default=[os.path.join(ROOT, "tests/data/kv_quality/prompt.txt")])
    ap.add_argument("--chars", type=int, default=16000, help="the text's first C characters (~4K tokens)")
    ap.add_argument("--from", dest="start", type=int, default=2048)
    ap.add_argument("--positions", type=int, default=200)
    ap.add_argument("--windows", type=int, default=0, help="also report each W positions apart")
    ap.add_argument("--modes", default="f16,bf16,q8,q4,turbo")
    ap.add_argument("--kv-group-size", type=int, default=64, help="q8/q4 group size (32, 64, 128)")
    ap.add_argument("--turbo-hot-window", type=int, default=256, help="turbo's uncompressed recent tokens")
    ap.add_argument("--turbo-keys", default="mse", choices=["mse", "qjl"], help="turbo's key codes")
    ap.add_argument("--peregrine", default=os.path.join(ROOT, "target/release/peregrine"))
    ap.add_argument("--threads", type=int, default=2)
    a = ap.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        text_file = os.path.join(tmp, "prompt.txt")
        with open(text_file, "w") as f:
            f.write("\n\n".join(open(t).read() for t in a.text)[:a.chars])
        ref = logits(a, text_file, "f32", os.path.join(tmp, "f32.safetensors"))
        n = ref["logits"].shape[0]
        if n < a.positions:
            sys.exit(f"kv_quality: the text has {a.start + n} tokens; --from + --positions "
                     f"needs {a.start + a.positions}")
        lp = log_softmax(ref["logits"])
        for mode in a.modes.split(","):
            got = logits(a, text_file, mode, os.path.join(tmp, f"{mode}.safetensors"))["logits"]
            lq = log_softmax(got)
            kl = (np.exp(lp) * (lp - lq)).sum(axis=-1)
            same = ref["logits"].argmax(-1) == got.argmax(-1)
            top1 = float(same.mean())
            label = f"{mode} g{a.kv_group_size}" if mode in ("q8", "q4") else mode
            label = f"turbo {a.turbo_keys}" if mode == "turbo" else label
            windows = {f"{a.start + w}..{a.start + min(w + a.windows, n)}":
                       {"top1": float(same[w:w + a.windows].mean()),
                        "mean_kl": float(kl[w:w + a.windows].mean())}
                       for w in range(0, n, a.windows)} if a.windows else {}
            print(json.dumps({"model": os.path.basename(a.model), "mode": label,
                              "positions": f"{a.start}..{a.start + n}",
                              "prompt_tokens": int(len(ref["input_ids"])),
                              "top1_vs_f32": top1, "mean_kl_vs_f32": float(kl.mean()),
                              "max_kl_vs_f32": float(kl.max()),
                              **({"windows": windows} if windows else {})}), flush=True)


if __name__ == "__main__":
    main()
