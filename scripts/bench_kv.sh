#!/usr/bin/env bash
# Decode and prefill speed by KV storage: Peregrine against llama.cpp on the same GGUF file in the
# same run for f16, q8_0 and q4_0 KV (benches/compare_llama_cpp.py), then Peregrine's TurboQuant alone
# (llama.cpp has none), at 512 and 8,000 prompt tokens, 2 threads. One JSON line per run, with
# the load average before it on stderr.
#
# usage: scripts/bench_kv.sh [REPEAT]   (needs target/release/peregrine and .venv-ref)
set -euo pipefail
cd "$(dirname "$0")/.."
repeat=${1:-1}
models=${PEREGRINE_MODELS:-$HOME/.cache/peregrine/models}
for model in SmolLM2-135M-Instruct.Q4_1.gguf gemma-3-270m-q4_k_m.gguf; do
  for prompt in 512 8000; do
    for kv in f16 q8_0 q4_0; do
      echo "# $(uptime | sed 's/.*load/load/')" >&2
      .venv-ref/bin/python benches/compare_llama_cpp.py --model "$models/$model" --prompt-tokens "$prompt" \
        --gen-tokens 32 --threads 2 --repeat "$repeat" --warmup 0 --cache-type "$kv" 2>/dev/null
    done
    echo "# $(uptime | sed 's/.*load/load/')" >&2
    target/release/peregrine --threads 2 bench --model "$models/$model" --prompt-tokens "$prompt" \
      --gen-tokens 32 --repeat "$repeat" --warmup 0 --turbo-kv --json 2>/dev/null |
      python3 -c "import json,sys; d=json.load(sys.stdin); d['kv']='turbo'; print(json.dumps(d))"
  done
done
