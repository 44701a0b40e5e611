#!/usr/bin/env bash
# Builds scripts/cuda/q4k_bench.cu (our Q4_K GEMV against candle's MMVQ, timed alone) for sm_90
# into carry/cuda/q4k_bench; run that binary on the GPU machine (no arguments, ~1 minute).
# Needs the CUDA toolkit of ../shared/CUDA.md (nvcc on PATH, or CUDA_HOME).
set -euo pipefail
cd "$(dirname "$0")/../.."
[ -n "${CUDA_HOME:-}" ] && export PATH="$CUDA_HOME/bin:$PATH"
candle=$(cargo metadata --format-version 1 --locked --all-features | python3 -c '
import json, os, sys
pkgs = json.load(sys.stdin)["packages"]
print(os.path.dirname(next(p["manifest_path"] for p in pkgs if p["name"] == "candle-kernels")))')
mkdir -p carry/cuda
nvcc -O3 -std=c++17 -arch=sm_${CUDA_COMPUTE_CAP:-90} -o carry/cuda/q4k_bench \
  scripts/cuda/q4k_bench.cu "$candle/src/mmvq_gguf.cu"
echo "built carry/cuda/q4k_bench"
