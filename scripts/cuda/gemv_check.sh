#!/usr/bin/env bash
# On a GPU machine: the dense GEMV kernels (tests/dense_cuda.rs), then a random Llama-3.1-8B
# (2 layers made, inflated to 32 by inflate_gguf.py) as f16 GGUF and llama-quantize's Q4_K_M,
# decoded by each GEMV variant of one binary (cuBLAS and our GEMV; candle's MMVQ and our
# kernels for Q4_K, and Q4_K and Q6_K), alternating, and Nsight Compute's GPU time per kernel
# over one decode token of each file (when `ncu` is on the machine). About 5 minutes.
# usage: scripts/cuda/gemv_check.sh [all|q4k]   (q4k: the Q4_K kernels' test and Q4_K_M only)
# ROUNDS=N alternating rounds (default 3); NCU=0 skips the Nsight Compute pass.
# Carry: carry/cuda/{peregrine.xz,libcudart.so.13} (scripts/cuda/build.sh --bundle), the test
# binaries carry/cuda/tests/{dense,gguf}_cuda.xz (stripped, xz), carry/lcpp/quantize.tar.xz.
cd "$(dirname "$0")/../.."
source scripts/cuda/unpack.sh
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader
what=${1:-all}
tests=dense_cuda
[ "$what" = q4k ] && tests=gguf_cuda
for t in $tests; do
  xz -dc carry/cuda/tests/$t.xz > /tmp/$t && chmod +x /tmp/$t
  echo "== $t"; timeout 120 /tmp/$t 2>&1 | grep -E "^test |test result|panicked|against" | head -12
done
m=/tmp/m8b
python3 scripts/cuda/make_shaped.py $m --layers 2 > /tmp/make.log 2>&1; tail -1 /tmp/make.log
peregrine quantize -m $m --format gguf --type f16 --out $m-f16.gguf > /tmp/q.log 2>&1 || tail -3 /tmp/q.log
mkdir -p /tmp/lq && tar xJf carry/lcpp/quantize.tar.xz -C /tmp/lq
LD_LIBRARY_PATH=/tmp/lq /tmp/lq/llama-quantize $m-f16.gguf $m-q4km.gguf Q4_K_M 16 > /tmp/lq.log 2>&1
files="f16 q4km"
[ "$what" = q4k ] && files=q4km
for f in $files; do
  python3 scripts/cuda/inflate_gguf.py $m-$f.gguf ${m}32-$f.gguf --layers 32 2>&1 | tail -1
done
bench() { # file, then VAR=value settings
  local f=$1; shift
  echo -n "$f $* : "
  env "$@" timeout 60 peregrine bench -m ${m}32-$f.gguf --device cuda --prompt-tokens 512 \
    --gen-tokens 64 --repeat 2 --warmup 1 2>/dev/null \
    | grep -o '"prefill_tps":[0-9.]*\|"decode_tps":[0-9.]*' | tr '\n' ' '; echo
}
for round in $(seq "${ROUNDS:-3}"); do
  if [ "$what" != q4k ]; then
    bench f16 PEREGRINE_CUDA_GEMV_ROWS=0
    bench f16 PEREGRINE_CUDA_GEMV_ROWS=1
  fi
  # candle's MMVQ, ours for Q4_K only, ours for Q4_K and Q6_K (the default).
  bench q4km PEREGRINE_CUDA_GGUF_GEMV=0
  bench q4km PEREGRINE_CUDA_GGUF_GEMV=q4k
  bench q4km PEREGRINE_CUDA_GGUF_GEMV=1
done
[ "${NCU:-1}" = 0 ] && exit 0  # NCU=0: no Nsight Compute pass
ncu=$(command -v ncu || ls /usr/local/cuda/bin/ncu /opt/nvidia/nsight-compute/*/ncu 2>/dev/null | head -1)
[ -n "$ncu" ] || { echo "no ncu"; exit 0; }
for f in $files; do
  # Skip the load's and the 1-token prompt's kernels: the tail of 6 tokens repeats per token.
  timeout 150 "$ncu" --clock-control none --metrics gpu__time_duration.sum --csv -c 6000 peregrine bench \
    -m ${m}32-$f.gguf --device cuda --prompt-tokens 1 --gen-tokens 6 --repeat 1 --warmup 0 \
    > /tmp/ncu-$f.csv 2>/dev/null
  echo "== ncu $f"; python3 scripts/cuda/ncu_table.py /tmp/ncu-$f.csv --last-token
done
