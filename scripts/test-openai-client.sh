#!/usr/bin/env bash
# Drive `peregrine serve` with the official `openai` Python client (tests/openai_client).
#   1. creates the git-ignored venv .venv-openai and installs openai, anthropic, pytest,
#      jsonschema, selenium and the llm-comply spec checker into it (once; pinned), and Debian's
#      chromium and chromium-driver for the chat page's browser test when they are missing,
#   2. fetches SmolLM2-135M-Instruct (scripts/fetch-models.sh smollm2) and builds the binary,
#   3. starts the server on a free loopback port, runs pytest, stops the server (some tests
#      start servers of their own with other flags: keep-alive, loading).
# Usage: scripts/test-openai-client.sh [pytest args...]
# Env: PEREGRINE_BIN (skip the build and use this binary), PYTHON (default python3).
set -euo pipefail
cd "$(dirname "$0")/.."
VENV=.venv-openai
PY="${PYTHON:-python3}"

if [ ! -x "$VENV/bin/python" ]; then
  "$PY" -m venv "$VENV"
fi
if ! "$VENV/bin/python" -c "import openai, pytest, jsonschema, anthropic, llm_comply, selenium" 2>/dev/null; then
  "$VENV/bin/pip" install --quiet "openai==3.57.0" "pytest==9.2.0" "jsonschema==4.26.0" \
    "anthropic==2.16.0" "llm-comply==0.5.0" "selenium==4.50.0"
fi
if [ ! -x /usr/bin/chromium ] || [ ! -x /usr/bin/chromedriver ]; then
  echo "installing Debian's chromium and chromium-driver for tests/openai_client/test_webui.py" >&2
  SUDO=""; [ "$(id -u)" = 0 ] || SUDO=sudo
  $SUDO apt-get update -qq >&2
  DEBIAN_FRONTEND=noninteractive $SUDO apt-get install -y -qq chromium chromium-driver >&2
fi

MODEL_PATH="$(scripts/fetch-models.sh smollm2 | tail -n 1)"
if [ -z "${PEREGRINE_BIN:-}" ]; then
  cargo build --quiet -p peregrine-server
  PEREGRINE_BIN=target/debug/peregrine
fi

LOG="$(mktemp)"
"$PEREGRINE_BIN" serve --model "$MODEL_PATH" --port 0 --parallel 2 --alias smollm2 2>"$LOG" &
SERVER=$!
trap 'kill "$SERVER" 2>/dev/null || true; wait "$SERVER" 2>/dev/null || true; rm -f "$LOG"' EXIT

ADDR=""
for _ in $(seq 1 600); do
  ADDR="$(sed -n 's|.*listening on http://\([^ ]*\).*|\1|p' "$LOG" | head -n 1)"
  if [ -n "$ADDR" ] && "$VENV/bin/python" -c "import urllib.request as u; u.urlopen('http://$ADDR/health')" 2>/dev/null; then
    break
  fi
  kill -0 "$SERVER" 2>/dev/null || { cat "$LOG"; echo "the server exited" >&2; exit 1; }
  sleep 0.5
done
echo "peregrine serving SmolLM2 on $ADDR"

# PEREGRINE_BIN and PEREGRINE_MODEL_PATH: for the tests that start servers of their own.
PEREGRINE_BASE_URL="http://$ADDR/v1" PEREGRINE_MODEL=smollm2 \
  PEREGRINE_BIN="$PEREGRINE_BIN" PEREGRINE_MODEL_PATH="$MODEL_PATH" \
  "$VENV/bin/python" -m pytest -q tests/openai_client "$@"
