#!/usr/bin/env bash
# The whole test suite: fetch the real test models into the cache (once; checksum-verified), run
# every Rust test in the workspace (examples are built and run by tests/integration/examples.rs),
# then the official `openai` Python client and the chat page in headless Chromium against
# `peregrine serve` (scripts/test-openai-client.sh), build the benchmarks and the docs, package the
# crates, and close with the test totals over all of them.
# Extra arguments go to `cargo test`.
set -euo pipefail
cd "$(dirname "$0")/.."
scripts/fetch-models.sh all >&2
log="$(mktemp)"
trap 'rm -f "$log"' EXIT
status=0
cargo test --workspace --locked "$@" 2>&1 | tee "$log" || status=$?
PEREGRINE_BIN=target/debug/peregrine scripts/test-openai-client.sh 2>&1 | tee -a "$log" || status=$?
# The benchmarks in benches/ build (they are run by hand: speed is measured, never tested).
echo "benches: cargo build -p peregrine --benches"
cargo build -p peregrine --benches --locked 2>&1 | tail -n 1 || status=$?
# The crates as users get them: docs build without warnings, and every library packages.
echo "docs: RUSTDOCFLAGS=-D warnings cargo doc --workspace --no-deps"
RUSTDOCFLAGS="-D warnings" cargo doc --workspace --no-deps --locked 2>&1 | tail -n 3 || status=$?
echo "packages: cargo package --workspace --no-verify"
cargo package --workspace --no-verify --locked --allow-dirty 2>&1 | grep -v "^warning: ignoring" | tail -n 2 || status=$?
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
