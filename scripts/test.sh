#!/usr/bin/env bash
# The whole test suite: fetch the real test models into the cache (once; checksum-verified),
# then run every Rust test in the workspace. Extra arguments go to `cargo test`.
set -euo pipefail
cd "$(dirname "$0")/.."
scripts/fetch-models.sh all >&2
cargo test --workspace --locked "$@"
