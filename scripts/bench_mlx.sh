#!/usr/bin/env bash
# Speed and memory of bf16 vs MLX 4-bit and 8-bit (group 64) vs GGUF Q4_0 and Q8_0 of the same
# weights, and llama.cpp on the same GGUF files, on random-weight checkpoints of
# real model shapes (Qwen2.5-0.5B, SmolLM2-135M, Gemma 3 270M). Prints one JSON line per run
# (peregrine bench's report plus `shape`, `format`, `file_bytes`, `load_1min`).
#
# usage: scripts/bench_mlx.sh [shape ...]        (default: qwen2.5-0.5b smollm2-135m gemma3-270m)
# env:   PY            python with torch + transformers (default .venv-fixtures/bin/python,
#                      made by scripts/fixtures/setup.sh)
#        PEREGRINE     the binary (default: builds and uses target/release/peregrine)
#        THREADS       compute threads (default 2)
#        CACHE         checkpoint cache (default ~/.cache/peregrine/bench; never committed)
#        MAX_LOAD      wait (up to WAIT_S seconds, default 600) for the 1-minute load average
#                      to drop below this before each run (default 1.3); the JSON records it
#        REF_PY        python with llama-cpp-python (default .venv-ref/bin/python, made by
#                      scripts/setup-ref-venv.sh): when present, llama.cpp runs both GGUF files
#                      (two more lines per shape, `format` "llama.cpp q4_0.gguf" and
#                      "llama.cpp q8_0.gguf")
set -euo pipefail
ROOT="$(cd "$(dirname "$0")/.." && pwd)"
PY="${PY:-$ROOT/.venv-fixtures/bin/python}"
CACHE="${CACHE:-$HOME/.cache/peregrine/bench}"
THREADS="${THREADS:-2}"
MAX_LOAD="${MAX_LOAD:-1.3}"
WAIT_S="${WAIT_S:-600}"
SHAPES=("$@")
[[ ${#SHAPES[@]} -gt 0 ]] || SHAPES=(qwen2.5-0.5b smollm2-135m gemma3-270m)

if [[ -z "${PEREGRINE:-}" ]]; then
  (cd "$ROOT" && cargo build --release -q -p peregrine-server)
  PEREGRINE="${CARGO_TARGET_DIR:-$ROOT/target}/release/peregrine"
fi

load1() { cut -d' ' -f1 /proc/loadavg; }
wait_quiet() {
  local waited=0
  while awk -v l="$(load1)" -v m="$MAX_LOAD" 'BEGIN { exit !(l >= m) }' && ((waited < WAIT_S)); do
    sleep 10
    waited=$((waited + 10))
  done
}
size_of() { du -sb --apparent-size "$1" | cut -f1; }

for shape in "${SHAPES[@]}"; do
  dir="$CACHE/$shape"
  [[ -f "$dir/bf16/config.json" ]] || "$PY" "$ROOT/scripts/bench_mlx_make.py" "$shape" "$dir/bf16" >&2
  [[ -f "$dir/mlx-4bit-g64/config.json" ]] ||
    "$PEREGRINE" quantize --model "$dir/bf16" --out "$dir/mlx-4bit-g64" --bits 4 --group-size 64 >&2
  [[ -f "$dir/mlx-8bit-g64/config.json" ]] ||
    "$PEREGRINE" quantize --model "$dir/bf16" --out "$dir/mlx-8bit-g64" --bits 8 --group-size 64 >&2
  for type in q4_0 q8_0; do
    [[ -f "$dir/$type.gguf" ]] ||
      "$PEREGRINE" quantize --model "$dir/bf16" --out "$dir/$type.gguf" --format gguf --type $type >&2
  done
  # bf16 last: its 1-2 GB load and release disturbed the runs that followed it.
  for format in mlx-4bit-g64 q4_0.gguf mlx-8bit-g64 q8_0.gguf bf16; do
    model="$dir/$format"
    weights="$model"
    [[ -d "$model" ]] && weights="$model/model.safetensors"
    wait_quiet
    load="$(load1)"
    # KV in f16 on both sides (compare_llama_cpp.py's default for llama.cpp below).
    report="$("$PEREGRINE" --threads "$THREADS" bench --model "$model" \
      --prompt-tokens 40 --gen-tokens 64 --repeat 3 --cache-type f16 --json)"
    "$PY" -c 'import json, sys
r = json.loads(sys.argv[1])
r.update(shape=sys.argv[2], format=sys.argv[3], file_bytes=int(sys.argv[4]), load_1min=float(sys.argv[5]))
print(json.dumps(r))' "$report" "$shape" "$format" "$(size_of "$weights")" "$load"
  done
  REF_PY="${REF_PY:-$ROOT/.venv-ref/bin/python}"
  for type in q4_0 q8_0; do
    [[ -x "$REF_PY" ]] || break
    wait_quiet
    load="$(load1)"
    "$REF_PY" "$ROOT/benches/compare_llama_cpp.py" --model "$dir/$type.gguf" --skip-peregrine \
      --prompt-tokens 40 --gen-tokens 64 --threads "$THREADS" --repeat 3 2>/dev/null |
      "$PY" -c 'import json, sys
r = json.loads(sys.stdin.read().strip().splitlines()[-1])["llama_cpp"]
r.update(shape=sys.argv[1], format="llama.cpp " + sys.argv[3], load_1min=float(sys.argv[2]))
print(json.dumps(r))' "$shape" "$load" "$type.gguf"
  done
done
