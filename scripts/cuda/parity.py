#!/usr/bin/env python3
"""Golden-logit parity of a device build: every fixture under tests/fixtures run through
`peregrine logits` on each device named, compared with transformers' f32 logits (for MLX-quantized
weights: transformers on the same weights dequantized) and, off the CPU, with the CPU's logits
(the only comparison for quantized GGUF files, whose reference is llama.cpp's).

usage: scripts/cuda/parity.py PEREGRINE [--devices cpu,cuda] [--tolerance 0.15] [--margin 0.3] [--only NAME]
Needs numpy and safetensors. Prints one line per fixture and device; exits 1 when a device
other than the CPU differs from the reference by more than the tolerance at any logit, or
picks another top token where the reference's top two are more than `--margin` apart
(twice the tolerance: two logits each moved by up to the tolerance may trade places).

Tolerance 0.15: the GPU computes in bf16 (8 significant bits: each rounding moves a value by up
to 2^-9 of itself) while the reference is f32. The fixtures' logits have a standard deviation of
about 1 and reach about 4; on the H200 (2026-12-05) Llama, Mistral, Mixtral, Qwen 2/3, Phi-3,
Gemma 2/3, DeepSeek-V3, Mamba 2 and Falcon-H1 landed at 0.02-0.10, MLX weights of every bit width
included (docs/cuda.md has the rest). A real bug (a wrong RoPE pair, a missing
bias, a mask off by one) moves them by 0.3 or more, as the CPU's golden tests found.
"""
import argparse
import subprocess
import sys
import tempfile
from pathlib import Path

import numpy as np
from safetensors.numpy import load_file

ROOT = Path(__file__).resolve().parents[2]


def cases(only):
    """(name, model path, ids, reference logits) of every fixture with reference logits."""
    fixtures = ROOT / "tests/fixtures"
    for ref_path in sorted(fixtures.glob("*/*/reference.safetensors")):
        d = ref_path.parent
        if only and only not in str(d.relative_to(fixtures)):
            continue
        ref = load_file(str(ref_path))
        hf_path = d.parent / "hf/reference.safetensors"
        hf = ref if d.name == "hf" else load_file(str(hf_path)) if hf_path.exists() else {}
        if "logits" not in hf:
            continue  # not a logits fixture (the Gemma 4 assistant's drafts)
        ids = hf["input_ids"].astype(np.int64).tolist()
        if (d / "config.json").exists():
            yield d.relative_to(fixtures), d, ids, ref["logits"]
        for g in sorted(d.glob("*.gguf")):
            # unquantized files against transformers; quantized ones against our CPU (their
            # reference is llama.cpp's, which the CPU tests compare with a looser rule)
            exact = g.stem in ("model-f32", "model-bf16", "model-f16")
            yield g.relative_to(fixtures), g, ids, hf["logits"] if exact else None


def logits(exe, model, device, ids, out):
    cmd = [exe, "logits", "--model", str(model), "--device", device, "--input-ids",
           ",".join(map(str, ids)), "--out", str(out), "--mlx-activations", "f32"]
    run = subprocess.run(cmd, capture_output=True, text=True)
    if run.returncode != 0:
        return None, run.stderr.strip().splitlines()[-1:] or ["(no message)"]
    return load_file(str(out))["logits"], None


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("exe")
    ap.add_argument("--devices", default="cpu,cuda")
    ap.add_argument("--tolerance", type=float, default=0.15)
    ap.add_argument("--margin", type=float, default=0.3)
    ap.add_argument("--only")
    a = ap.parse_args()
    failed = 0
    with tempfile.TemporaryDirectory() as tmp:
        for name, model, ids, want in cases(a.only):
            cpu = None
            for dev in a.devices.split(","):
                got, err = logits(a.exe, model, dev, ids, Path(tmp) / "out.safetensors")
                if got is None:
                    print(f"{name} [{dev}]: ERROR {err[0]}")
                    failed += dev != "cpu"
                    continue
                if dev == "cpu":
                    cpu = got
                line, bad = f"{name} [{dev}]:", False
                for what, ref in (("reference", want), ("cpu", None if dev == "cpu" else cpu)):
                    if ref is None:
                        continue
                    top2 = np.sort(ref, axis=-1)[:, -2:]
                    clear = (top2[:, 1] - top2[:, 0]) > a.margin
                    diff = float(np.abs(got - ref).max())
                    same = got.argmax(-1) == ref.argmax(-1)
                    line += f" vs {what} max abs diff {diff:.2e}, top-1 {same.sum()}/{len(same)};"
                    bad |= diff > a.tolerance or not same[clear].all()
                print(line + ("  FAIL" if bad else ""))
                failed += bad and dev != "cpu"
    print(f"{failed} failed")
    sys.exit(1 if failed else 0)


if __name__ == "__main__":
    main()
