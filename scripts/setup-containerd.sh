#!/usr/bin/env bash
# Makes containerd 1.7 (with its CRI and NRI plugins) available without touching the system's
# packages: Debian 13's containerd package is unpacked into a private prefix (its binaries run
# on Debian 12; Debian 12's own containerd 1.6 has no NRI). The Kubernetes tests start it as
# their child, with Debian 12's runc.
#
# Usage: scripts/setup-containerd.sh [PREFIX]   (default: .stasis/containerd)
# Prints the directory holding containerd, its shims and ctr on its last line.
set -euo pipefail

root=$(cd "$(dirname "$0")/.." && pwd)
prefix=$(realpath -m "${1:-$root/.stasis/containerd}")
bin=$prefix/usr/bin
if [ -x "$bin/containerd" ] && "$bin/containerd" --version >/dev/null 2>&1; then
  echo "$bin"; exit 0
fi
echo "setup-containerd: fetching containerd from Debian trixie into $prefix" >&2
# shellcheck source=scripts/debs.sh
. "$root/scripts/debs.sh"
unpack_debs trixie "$prefix" containerd
rm -rf "$prefix" && mv "$prefix.tmp" "$prefix"
"$bin/containerd" --version >&2
echo "$bin"
