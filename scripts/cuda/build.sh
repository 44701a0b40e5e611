#!/usr/bin/env bash
# Builds the CUDA `peregrine` binary on a machine without a GPU or CUDA install, and a bundle to
# run it on one: carry/cuda/peregrine.xz (stripped, compressed) and libcudart.so.13.
# usage: scripts/cuda/build.sh [--bundle]
# The toolkit (CUDA 13.0 from Python wheels, ~650 MB, once) comes from setup-toolkit.sh; the
# first build compiles candle's kernels (20-30 minutes on 2 cores), later ones take seconds.
# Output: target/cuda/release/peregrine. On the GPU machine it needs the driver's libcuda.so.1
# and cuBLAS / cuRAND 13 (LD_LIBRARY_PATH=<bundle>:/usr/local/cuda/lib64).
# With a normal CUDA 12.x/13.x install instead: cargo build --release -p peregrine-server --features cuda
set -euo pipefail
cd "$(dirname "$0")/../.."
toolkit=${CUDA_TOOLKIT_DIR:-$HOME/.cache/cuda13}
cargo fetch --locked
scripts/cuda/setup-toolkit.sh "$toolkit"
# shellcheck disable=SC1091
source "$toolkit/env.sh"
# Hopper (sm_90a) by default; the same three variables on every build, or the kernels recompile.
export CUDA_COMPUTE_CAP=${CUDA_COMPUTE_CAP:-90} CUDAFORGE_THREADS=${CUDAFORGE_THREADS:-2}
# A target folder of its own: the CPU build's is left as it is.
CARGO_TARGET_DIR=target/cuda cargo build --release --locked -p peregrine-server --features cuda --bin peregrine
echo "built target/cuda/release/peregrine"
if [ "${1:-}" = "--bundle" ]; then
  mkdir -p carry/cuda
  strip -o carry/cuda/peregrine target/cuda/release/peregrine
  xz -f -T2 -6 carry/cuda/peregrine
  cp -L "$toolkit/cuda/lib64/libcudart.so.13" carry/cuda/
  ls -la carry/cuda
fi
