#!/usr/bin/env bash
# Builds llama.cpp's CUDA llama-bench and llama-server from the llama-cpp-python sdist's source
# (the llama.cpp the comparisons use) on a machine without a GPU, with the CUDA 13.0 toolkit
# setup-toolkit.sh unpacks, and bundles them with llama.cpp's CPU llama-quantize (for Q4_K_M
# files) to carry to a GPU machine (scripts/cuda/compare.sh runs them): carry/lcpp/llama-bench.xz,
# carry/lcpp/quantize.tar.xz (its libraries, libgomp, libssl and libcrypto beside it; run with
# LD_LIBRARY_PATH pointing there) and carry/lsrv/llama-server.xz.
# usage: scripts/cuda/build-llama-cpp.sh     (about 25 minutes of 2 cores; later runs reuse it)
# env: LLAMA_CPP (the source tree; default: the sdist fetched into ~/.cache/peregrine/sdist),
#      CMAKE (a cmake 3.14+; default `cmake`, then ~/.cache/peregrine/cmake-venv's, installed by pip)
set -euo pipefail
cd "$(dirname "$0")/../.."
root=$(pwd)
version=0.3.36 # as scripts/setup-ref-venv.sh
cache=${PEREGRINE_SDIST_CACHE:-$HOME/.cache/peregrine/sdist}
src=${LLAMA_CPP:-$cache/llama_cpp_python-$version/vendor/llama.cpp}
if [ ! -f "$src/CMakeLists.txt" ]; then
  mkdir -p "$cache"
  python3 -m pip download --no-deps --no-binary llama-cpp-python "llama-cpp-python==$version" -d "$cache"
  tar xzf "$cache/llama_cpp_python-$version.tar.gz" -C "$cache"
fi
cmake=${CMAKE:-$(command -v cmake || true)}
if [ -z "$cmake" ]; then
  venv=$HOME/.cache/peregrine/cmake-venv
  [ -x "$venv/bin/cmake" ] || { python3 -m venv "$venv" && "$venv/bin/pip" install -q cmake ninja; }
  cmake=$venv/bin/cmake
  export PATH=$venv/bin:$PATH
fi
toolkit=${CUDA_TOOLKIT_DIR:-$HOME/.cache/cuda13}
scripts/cuda/setup-toolkit.sh "$toolkit"
# shellcheck disable=SC1091
source "$toolkit/env.sh"
generator=$(command -v ninja > /dev/null && echo Ninja || echo "Unix Makefiles")
# Hopper only; static, so the bundle is one file (cuBLAS and the driver come from the GPU machine).
"$cmake" -S "$src" -B "$src/build-cuda" -G "$generator" -DCMAKE_BUILD_TYPE=Release \
  -DGGML_CUDA=ON -DCMAKE_CUDA_ARCHITECTURES=90 -DGGML_NATIVE=OFF -DLLAMA_CURL=OFF \
  -DBUILD_SHARED_LIBS=OFF -DLLAMA_BUILD_TESTS=OFF -DCUDAToolkit_ROOT="$CUDA_HOME" \
  -DCMAKE_CUDA_COMPILER="$CUDA_HOME/bin/nvcc"
nice -n 19 "$cmake" --build "$src/build-cuda" -j 2 --target llama-bench llama-server
# The CPU build (shared libraries) for llama-quantize: the CUDA one is 66 MB statically linked.
"$cmake" -S "$src" -B "$src/build-cpu" -G "$generator" -DCMAKE_BUILD_TYPE=Release \
  -DGGML_NATIVE=OFF -DLLAMA_CURL=OFF -DLLAMA_BUILD_TESTS=OFF
nice -n 19 "$cmake" --build "$src/build-cpu" -j 2 --target llama-quantize
out=$root/carry/lcpp
mkdir -p "$out"
strip -o "$out/llama-bench" "$src/build-cuda/bin/llama-bench"
xz -f -T2 -9 "$out/llama-bench"
# The server apart (41 MB compressed, as llama-bench: both link all of ggml's CUDA kernels, and
# a call carries at most 64 MiB), for scripts/bench_batching.py --device cuda.
mkdir -p "$root/carry/lsrv"
strip -o "$root/carry/lsrv/llama-server" "$src/build-cuda/bin/llama-server"
xz -f -T2 -6 "$root/carry/lsrv/llama-server"
stage=$(mktemp -d)
cp -L "$src/build-cpu/bin/llama-quantize" "$src"/build-cpu/bin/lib*.so* "$stage/"
for lib in libgomp.so.1 libssl.so.3 libcrypto.so.3; do
  cp -L "$(ldconfig -p | awk -v l="$lib" '$1 == l {print $NF; exit}')" "$stage/"
done
strip "$stage"/* 2> /dev/null || true
tar cf - -C "$stage" . | xz -T2 -9 > "$out/quantize.tar.xz"
rm -rf "$stage"
ls -la "$out"
