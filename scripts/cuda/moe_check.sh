#!/usr/bin/env bash
# On a GPU machine: the MoE expert tables and routing on the device (docs/cuda.md, "MoE on the
# GPU") — tests/moe_cuda.rs, then a full-depth random Qwen3-30B-A3B Q4_K_M (2 layers made,
# llama-quantize, inflated to 48) decoded routed on the device and by the host, 8 streams, and
# greedy texts on the 2-layer file with device routing off / on; prefill with the tokens grouped
# by expert (PEREGRINE_CUDA_MOE_GROUPED) on and off. About 3 minutes on an H100.
# Carry: carry/cuda/{peregrine.xz,libcudart.so.13} (scripts/cuda/build.sh --bundle),
# carry/cuda/tests/moe_cuda.xz (the test binary, stripped and xz-compressed),
# carry/lcpp/quantize.tar.xz (scripts/cuda/build-llama-cpp.sh).
cd "$(dirname "$0")/../.."
source scripts/cuda/unpack.sh
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader
xz -dc carry/cuda/tests/moe_cuda.xz > /tmp/moe_cuda && chmod +x /tmp/moe_cuda
echo "== moe_cuda"; timeout 60 /tmp/moe_cuda 2>&1 | grep -E "^test |test result|panicked|against|routed" | head -12
moe=/tmp/moe
python3 scripts/cuda/make_shaped.py $moe --shape qwen3-30b-a3b --layers 2 > /tmp/make.log 2>&1; tail -1 /tmp/make.log
peregrine quantize -m $moe --format gguf --type f16 --out $moe-f16.gguf > /tmp/q.log 2>&1 || tail -3 /tmp/q.log
mkdir -p /tmp/lq && tar xJf carry/lcpp/quantize.tar.xz -C /tmp/lq
LD_LIBRARY_PATH=/tmp/lq /tmp/lq/llama-quantize $moe-f16.gguf $moe-q4km.gguf Q4_K_M 16 > /tmp/lq.log 2>&1
python3 scripts/cuda/inflate_gguf.py $moe-q4km.gguf ${moe}48-q4km.gguf --layers 48 2>&1 | tail -1
for v in 1 0 1; do
  echo -n "MOE_ROUTE=$v batch 1: "
  PEREGRINE_CUDA_MOE_ROUTE=$v timeout 40 peregrine bench -m ${moe}48-q4km.gguf --device cuda --prompt-tokens 512 \
    --gen-tokens 64 --repeat 2 --warmup 1 2>/dev/null | grep -o '"prefill_tps":[0-9.]*\|"decode_tps":[0-9.]*' | tr '\n' ' '; echo
done
for v in 1 0; do
  echo -n "MOE_GROUPED=$v prefill: "
  PEREGRINE_CUDA_MOE_GROUPED=$v timeout 40 peregrine bench -m ${moe}48-q4km.gguf --device cuda --prompt-tokens 512 \
    --gen-tokens 8 --repeat 2 --warmup 1 2>/dev/null | grep -o '"prefill_tps":[0-9.]*'
done
echo -n "MOE_ROUTE=1 c=8: "
timeout 40 peregrine bench -m ${moe}48-q4km.gguf --device cuda --prompt-tokens 64 --gen-tokens 64 --repeat 1 \
  --warmup 0 --concurrency 8 2>/dev/null | grep -o '"aggregate_decode_tps":[0-9.]*'
echo "== batch_equal, 2 layers, 8 streams"
timeout 60 python3 scripts/cuda/batch_equal.py --model $moe-q4km.gguf --streams 8 \
  --var PEREGRINE_CUDA_MOE_ROUTE --peregrine "$(command -v peregrine)" 2>&1 | tail -n 4
echo "== batch_equal, 2 layers, 8 streams, prompts grouped by expert"
timeout 60 python3 scripts/cuda/batch_equal.py --model $moe-q4km.gguf --streams 8 \
  --var PEREGRINE_CUDA_MOE_GROUPED --peregrine "$(command -v peregrine)" 2>&1 | tail -n 4
