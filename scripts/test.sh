#!/usr/bin/env bash
# The whole test suite: fetch the real test models into the cache (once; checksum-verified),
# then run every Rust test in the workspace, and close with the totals over all test binaries.
# Extra arguments go to `cargo test`.
set -euo pipefail
cd "$(dirname "$0")/.."
scripts/fetch-models.sh all >&2
log="$(mktemp)"
trap 'rm -f "$log"' EXIT
status=0
cargo test --workspace --locked "$@" 2>&1 | tee "$log" || status=$?
# cargo prints one "test result:" line per test binary; sum them into one closing line.
awk '/^test result:/ { for (i = 1; i <= NF; i++) { if ($(i+1) ~ /^passed;?$/) p += $i; if ($(i+1) ~ /^failed;?$/) f += $i; if ($(i+1) ~ /^ignored;?$/) s += $i } }
     END { printf "%d passed, %d failed, %d skipped\n", p, f, s }' "$log"
exit "$status"
