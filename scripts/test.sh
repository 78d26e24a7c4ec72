#!/usr/bin/env bash
# Runs every test of stasis: formatting and lint gates, unit tests, and end-to-end tests
# against real CRIU and real processes (those need root). Installs what it needs itself:
# CRIU 4.x under .stasis/criu when the system has no usable one.
set -euo pipefail
root=$(cd "$(dirname "$0")/.." && pwd)
cd "$root"

scripts/setup-criu.sh >/dev/null
cargo fmt --all -- --check
cargo build --workspace --all-targets
cargo clippy --workspace --all-targets --quiet -- -D warnings
cargo test --workspace -- --test-threads=2
