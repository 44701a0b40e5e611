#!/usr/bin/env bash
# The whole test suite: fetch the real test models into the cache (once; checksum-verified), run
# every Rust test in the workspace, then the official `openai` Python client against
# `peregrine serve` (scripts/test-openai-client.sh), and close with the totals over all of them.
# Extra arguments go to `cargo test`.
set -euo pipefail
cd "$(dirname "$0")/.."
scripts/fetch-models.sh all >&2
log="$(mktemp)"
trap 'rm -f "$log"' EXIT
status=0
cargo test --workspace --locked "$@" 2>&1 | tee "$log" || status=$?
PEREGRINE_BIN=target/debug/peregrine scripts/test-openai-client.sh 2>&1 | tee -a "$log" || status=$?
# cargo prints one "test result: ... N passed; N failed; N ignored" line per test binary and
# pytest one "N passed, N failed in Ts" line: sum them into one closing line.
awk '/^test result:|^[0-9]+ (passed|failed).* in [0-9.]+s/ {
       gsub(/[;,]/, " ")
       for (i = 1; i < NF; i++) {
         if ($(i+1) == "passed") p += $i
         if ($(i+1) == "failed") f += $i
         if ($(i+1) == "ignored" || $(i+1) == "skipped") s += $i
       }
     }
     END { printf "%d passed, %d failed, %d skipped\n", p, f, s }' "$log"
exit "$status"
