#!/usr/bin/env bash
# Creates the llama.cpp reference venv `.venv-ref` at the repo root (git-ignored).
# Pinned versions; llama-cpp-python 0.3.x builds llama.cpp from source (cmake comes from the
# build-isolation environment), which takes a while on a 2-core machine.
# Usage: scripts/setup-ref-venv.sh            (idempotent: does nothing if .venv-ref/READY exists)
#        FORCE=1 scripts/setup-ref-venv.sh    (rebuild)
set -euo pipefail
ROOT="$(cd "$(dirname "$0")/.." && pwd)"
VENV="$ROOT/.venv-ref"
PY="${PYTHON:-python3}"

LLAMA_CPP_PYTHON_VERSION="0.3.36"
PINS=(
  "tokenizers==0.23.3"
  "numpy==2.4.6"
  "safetensors==0.8.0"
  "jinja2==3.1.6"
)

if [[ -f "$VENV/READY" && -z "${FORCE:-}" ]]; then
  echo "$VENV is ready (rm $VENV/READY or FORCE=1 to rebuild)"
  exit 0
fi
rm -f "$VENV/READY"
[[ -x "$VENV/bin/python" ]] || "$PY" -m venv "$VENV"
"$VENV/bin/python" -m pip install --upgrade --quiet "pip>=24"
"$VENV/bin/python" -m pip install "${PINS[@]}"
# Build llama.cpp from source, tuned for this CPU (reference numbers in compare_llama_cpp.py).
CMAKE_ARGS="${CMAKE_ARGS:--DGGML_NATIVE=ON}" CMAKE_BUILD_PARALLEL_LEVEL="${CMAKE_BUILD_PARALLEL_LEVEL:-2}" \
  nice -n 10 "$VENV/bin/python" -m pip install --no-cache-dir --verbose \
  "llama-cpp-python==$LLAMA_CPP_PYTHON_VERSION" > "$VENV/llama-cpp-build.log" 2>&1 \
  || { tail -50 "$VENV/llama-cpp-build.log"; echo "llama-cpp-python build failed (log: $VENV/llama-cpp-build.log)" >&2; exit 1; }
"$VENV/bin/python" - <<'PY'
import llama_cpp, tokenizers, numpy, safetensors, jinja2
print("llama_cpp", llama_cpp.__version__, "tokenizers", tokenizers.__version__, "numpy", numpy.__version__)
PY
touch "$VENV/READY"
echo "ready: $VENV"
