#!/usr/bin/env bash
# On a GPU machine, in one call: the bundle unpacked (scripts/cuda/unpack.sh), golden-logit
# parity of every fixture on the CPU and the GPU, a random Llama-3.1-8B-shaped checkpoint made
# there (bf16, then MLX 4-bit and GGUF Q4_0 by `peregrine quantize`), and `peregrine bench` on
# each at 512 and 8K prompt tokens. Writes logs to OUT (default $OUT) and prints a summary.
# usage: scripts/cuda/gpu_check.sh [parity|speed|all]   (default all; needs python3 with torch,
# numpy and safetensors, as the GPU machine has)
set -uo pipefail
here=$(cd "$(dirname "$0")/../.." && pwd)
out=${OUT:-/tmp/peregrine-gpu-check}
mkdir -p "$out"
# shellcheck disable=SC1091
source "$here/scripts/cuda/unpack.sh"
export RUST_BACKTRACE=0
what=${1:-all}
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader

model=/tmp/peregrine-llama8b
if [ "$what" != parity ] && [ ! -f "$model/config.json" ]; then
  # Made while the parity runs (the GPU draws the weights; the disk writes them).
  python3 "$here/scripts/cuda/make_shaped.py" "$model" > "$out/make.log" 2>&1 &
  maker=$!
fi
if [ "$what" != speed ]; then
  timeout 300 python3 "$here/scripts/cuda/parity.py" "$(command -v peregrine)" \
    --devices cpu,cuda > "$out/parity.log" 2>&1
  grep -E "FAIL|ERROR|failed" "$out/parity.log"
fi
[ "$what" = parity ] && exit 0
[ -n "${maker:-}" ] && wait "$maker"
tail -1 "$out/make.log"
[ -d "$model-mlx4" ] || peregrine quantize -m "$model" --out "$model-mlx4" > "$out/quantize.log" 2>&1
# The GGUF copy keeps Llama 3.1's RoPE scaling (a `rope_freqs` tensor, as llama.cpp writes it).
[ -f "$model-q4_0.gguf" ] || peregrine quantize -m "$model" --format gguf --type q4_0 \
  --out "$model-q4_0.gguf" >> "$out/quantize.log" 2>&1
for m in "$model" "$model-mlx4" "$model-q4_0.gguf"; do
  for p in 512 8000; do
    timeout 240 peregrine bench -m "$m" --device cuda --prompt-tokens "$p" --gen-tokens 64 \
      --repeat 2 --warmup 1 2>>"$out/bench.err" | tee -a "$out/bench.jsonl" | cut -c1-400
  done
done
