#!/usr/bin/env bash
# Makes `checkpointctl` (the tool that reads container checkpoint archives) available without
# touching the system's packages: Debian unstable's package and the libc it needs (newer than
# Debian 12's) are unpacked into a private prefix, with a wrapper that runs it through that
# libc's loader. The interop tests read stasis' exports with it.
#
# Usage: scripts/setup-checkpointctl.sh [PREFIX]   (default: .stasis/checkpointctl)
# Prints the path of the checkpointctl to use on its last line.
set -euo pipefail

root=$(cd "$(dirname "$0")/.." && pwd)
prefix=$(realpath -m "${1:-$root/.stasis/checkpointctl}")
wrapper=$prefix/bin/checkpointctl
if [ -x "$wrapper" ] && "$wrapper" --help >/dev/null 2>&1; then
  echo "$wrapper"; exit 0
fi
echo "setup-checkpointctl: fetching checkpointctl from Debian sid into $prefix" >&2
# shellcheck source=scripts/debs.sh
. "$root/scripts/debs.sh"
unpack_debs sid "$prefix" checkpointctl libc6
loader_wrapper "$prefix" checkpointctl "$prefix/usr/bin/checkpointctl"
rm -rf "$prefix" && mv "$prefix.tmp" "$prefix"
"$wrapper" --help >/dev/null
echo "$wrapper"
