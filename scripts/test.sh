#!/usr/bin/env bash
# Runs every test of stasis: formatting and lint gates, unit tests, and end-to-end tests
# against real CRIU, real processes and a real S3-compatible server on loopback (those need
# root). Installs what it needs itself: CRIU 4.x under .stasis/criu when the system has no
# usable one, and moto's S3 server (PyPI) in a virtual environment under .stasis/venv.
set -euo pipefail
root=$(cd "$(dirname "$0")/.." && pwd)
cd "$root"

scripts/setup-criu.sh >/dev/null
if [ ! -x .stasis/venv/bin/moto_server ]; then
  python3 -m venv .stasis/venv
  .stasis/venv/bin/pip install --quiet --disable-pip-version-check 'moto[server]'
fi
export STASIS_MOTO=$root/.stasis/venv/bin/moto_server
cargo fmt --all -- --check
cargo build --workspace --all-targets
cargo clippy --workspace --all-targets --quiet -- -D warnings
cargo test --workspace -- --test-threads=2
