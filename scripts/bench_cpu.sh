#!/usr/bin/env bash
# The CPU-speed comparison: Peregrine vs llama.cpp on the two real test models, 2 threads, prompt
# lengths 40 and 512, 64 greedy tokens, medians of 3, both KV caches in f16 (benches/compare_llama_cpp.py
# does each pair in one run). Prints one JSON line per model and prompt length, and the load average before each,
# since both systems slow down several-fold when other work shares the cores.
#
# usage: scripts/bench_cpu.sh [THREADS]   (needs target/release/peregrine and .venv-ref)
set -euo pipefail
cd "$(dirname "$0")/.."
threads=${1:-2}
models=${PEREGRINE_MODELS:-$HOME/.cache/peregrine/models}
[ -x target/release/peregrine ] || { echo "bench_cpu: build first: cargo build --release -p peregrine-server" >&2; exit 2; }
[ -x .venv-ref/bin/python ] || { echo "bench_cpu: run scripts/setup-ref-venv.sh first" >&2; exit 2; }
for model in SmolLM2-135M-Instruct.Q4_1.gguf gemma-3-270m-q4_k_m.gguf; do
  for prompt in 40 512; do
    echo "# $(uptime | sed 's/.*load/load/')" >&2
    .venv-ref/bin/python benches/compare_llama_cpp.py --model "$models/$model" --prompt-tokens "$prompt" \
      --gen-tokens 64 --threads "$threads" --repeat 3 2>/dev/null
  done
done
