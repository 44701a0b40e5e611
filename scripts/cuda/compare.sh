#!/usr/bin/env bash
# On a GPU machine: Peregrine against llama.cpp on random Llama-3.1-8B-shaped weights made
# there (docs/benchmarks.md, "CUDA: a random Llama-3.1-8B against llama.cpp"). Carry the
# bundles of scripts/cuda/build.sh --bundle (carry/cuda) and scripts/cuda/build-llama-cpp.sh
# (carry/lcpp: llama-bench, llama-quantize; carry/lsrv: llama-server); at 64 MiB a call, the
# stages go in separate calls on one warm machine (the weights stay in /tmp between them).
# usage: scripts/cuda/compare.sh make|bench|batch|moe
#   make:  bf16 safetensors (make_shaped.py), its f16 GGUF and MLX 4-bit (`peregrine quantize`),
#          and a Q4_K_M GGUF of the f16 one (llama-quantize); about 3 minutes on an H100 host
#   bench: llama-bench -fa 1 -p 512 -n 64 at depth 0 and 8192 on the f16 and Q4_K_M files, then
#          `peregrine bench` at 512 prompt tokens on each file and 8192 on Q4_K_M and bf16
#   batch: scripts/bench_batching.py --device cuda, both servers, STREAMS (default 1,8,32,64)
#          on FILES (default "q4km f16")
#   moe:   a Qwen3-30B-A3B-shaped Q4_K_M at full depth (48 layers: a 2-layer one made, quantized
#          by llama-quantize and inflated by inflate_gguf.py, as the full bf16 one does not fit
#          the disk), then llama-bench -p 512 -n 64 and `peregrine bench` on it (carry/lcpp)
# Output: OUT (default /tmp/peregrine-compare): llama-bench.md, bench.jsonl, batch-*.jsonl, logs.
set -uo pipefail
here=$(cd "$(dirname "$0")/../.." && pwd)
out=${OUT:-/tmp/peregrine-compare}
mkdir -p "$out"
# shellcheck disable=SC1091
source "$here/scripts/cuda/unpack.sh"
m=${MODEL:-/tmp/m8b}
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader
lib=/usr/local/cuda/lib64
case "${1:-}" in
make)
  [ -f "$m/config.json" ] || python3 "$here/scripts/cuda/make_shaped.py" "$m" > "$out/make.log" 2>&1
  tail -1 "$out/make.log"
  [ -f "$m-f16.gguf" ] || peregrine quantize -m "$m" --format gguf --type f16 --out "$m-f16.gguf" \
    > "$out/quantize-f16.log" 2>&1 &
  [ -d "$m-mlx4" ] || peregrine quantize -m "$m" --out "$m-mlx4" > "$out/quantize-mlx4.log" 2>&1 &
  wait
  if [ ! -f "$m-q4km.gguf" ]; then
    mkdir -p /tmp/llama-quantize
    tar xJf "$here/carry/lcpp/quantize.tar.xz" -C /tmp/llama-quantize
    LD_LIBRARY_PATH=/tmp/llama-quantize /tmp/llama-quantize/llama-quantize "$m-f16.gguf" \
      "$m-q4km.gguf" Q4_K_M "$(nproc)" > "$out/quantize-q4km.log" 2>&1
  fi
  ls -la "$(dirname "$m")" | grep "$(basename "$m")"
  ;;
bench)
  xz -dc "$here/carry/lcpp/llama-bench.xz" > /tmp/llama-bench && chmod +x /tmp/llama-bench
  for d in 0 8192; do
    LD_LIBRARY_PATH=$lib timeout 200 /tmp/llama-bench -m "$m-f16.gguf,$m-q4km.gguf" -ngl 99 \
      -fa 1 -p 512 -n 64 -d $d -r 2 -o md 2>> "$out/llama-bench.err" | tee -a "$out/llama-bench.md"
  done
  for run in "q4km.gguf 512" "bf16 512" "mlx4 512" "f16.gguf 512" "q4km.gguf 8192" "bf16 8192"; do
    set -- $run
    f=$m-$1
    [ "$1" = bf16 ] && f=$m
    timeout 100 peregrine bench -m "$f" --device cuda --prompt-tokens "$2" --gen-tokens 64 \
      --repeat 2 --warmup 1 2>> "$out/bench.err" | tee -a "$out/bench.jsonl"
  done
  ;;
batch)
  xz -dc "$here/carry/lsrv/llama-server.xz" > /tmp/llama-server && chmod +x /tmp/llama-server
  for f in ${FILES:-q4km f16}; do
    LD_LIBRARY_PATH=$lib:$LD_LIBRARY_PATH timeout "${LIMIT:-300}" python3 \
      "$here/scripts/bench_batching.py" --model "$m-$f.gguf" --device cuda --threads 8 \
      --peregrine "$(command -v peregrine)" --llama-server /tmp/llama-server \
      --streams "${STREAMS:-1,8,32,64}" --gen-tokens 64 | tee -a "$out/batch-$f.jsonl"
  done
  ;;
moe)
  moe=/tmp/moe
  [ -f "$moe/config.json" ] || python3 "$here/scripts/cuda/make_shaped.py" "$moe" \
    --shape qwen3-30b-a3b --layers 2 > "$out/make-moe.log" 2>&1
  tail -1 "$out/make-moe.log"
  [ -f "$moe-f16.gguf" ] || peregrine quantize -m "$moe" --format gguf --type f16 \
    --out "$moe-f16.gguf" > "$out/quantize-moe.log" 2>&1
  mkdir -p /tmp/llama-quantize
  tar xJf "$here/carry/lcpp/quantize.tar.xz" -C /tmp/llama-quantize
  LD_LIBRARY_PATH=/tmp/llama-quantize /tmp/llama-quantize/llama-quantize "$moe-f16.gguf" \
    "$moe-q4km.gguf" Q4_K_M "$(nproc)" > "$out/quantize-moe-q4km.log" 2>&1
  python3 "$here/scripts/cuda/inflate_gguf.py" "$moe-q4km.gguf" "${moe}48-q4km.gguf" --layers 48
  xz -dc "$here/carry/lcpp/llama-bench.xz" > /tmp/llama-bench && chmod +x /tmp/llama-bench
  LD_LIBRARY_PATH=$lib timeout 200 /tmp/llama-bench -m "${moe}48-q4km.gguf" -ngl 99 -fa 1 -p 512 \
    -n 64 -r 2 -o md 2>> "$out/llama-bench-moe.err" | tee -a "$out/llama-bench-moe.md"
  timeout 150 peregrine bench -m "${moe}48-q4km.gguf" --device cuda --prompt-tokens 512 \
    --gen-tokens 64 --repeat 2 --warmup 1 2>> "$out/bench-moe.err" | tee -a "$out/bench-moe.jsonl"
  ;;
*)
  echo "usage: scripts/cuda/compare.sh make|bench|batch|moe" >&2
  exit 2
  ;;
esac
