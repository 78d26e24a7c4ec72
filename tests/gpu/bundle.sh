#!/usr/bin/env bash
# Prepares what tests/gpu/device_check.sh runs on a GPU machine that reaches no package
# registry: release builds of stasisd, stasis, the lazy-restore guard, stasis-init and the GPU
# test programs, stasis-pod and libstasis_enter_root.so, stripped, and CRIU's private prefix (scripts/setup-criu.sh), all
# in .gpu-bundle/ (ignored by git; the device tool carries it; device_check.sh makes the pod
# bundle from them there). Run from anywhere, on x86-64.
set -euo pipefail
root=$(cd "$(dirname "$0")/../.." && pwd)
cd "$root"
bundle=$root/.gpu-bundle
cargo build --release --quiet -p stasis-daemon -p stasis-cli -p stasis-init -p stasis-enter-root -p stasis-gpu-tests
criu=$(scripts/setup-criu.sh | tail -n 1)
case $criu in
  "$root"/.stasis/criu/bin/criu) ;;
  *) echo "bundle: CRIU must come from scripts/setup-criu.sh's prefix, not $criu" >&2; exit 1 ;;
esac
rm -rf "$bundle" && mkdir -p "$bundle"
for bin in stasisd stasis stasis-lazy-guard stasis-init stasis-gpu-memtest stasis-gpu-probe; do
  strip -o "$bundle/$bin" "target/release/$bin"
done
# The prefix without its wrapper (device_check.sh writes one naming where the bundle is) and
# without documentation.
cp -a .stasis/criu "$bundle/criu"
rm -rf "$bundle/criu/bin" "$bundle/criu/usr/share"
strip -o "$bundle/stasis-pod" target/release/stasis-pod
strip -o "$bundle/libstasis_enter_root.so" target/release/libstasis_enter_root.so
du -sh "$bundle"
