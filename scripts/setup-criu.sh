#!/usr/bin/env bash
# Makes CRIU >= 4.2 available without touching the system's packages.
#
# Kernels from 6.16 on refuse SO_PASSCRED/SO_PASSSEC on network (TCP, UDP, packet) sockets,
# and CRIU before 4.2 gives up on the first such socket it dumps there. Debian unstable is a
# moving suite: whatever CRIU it has (4.2 or newer) is taken.
#
# If the system's criu is already 4.2 or newer and `criu check` passes, nothing is done.
# Otherwise the criu package of Debian unstable (sid, 4.2.1 at the time of writing) and the
# libraries it needs are downloaded with apt-get into a private directory, unpacked with
# `dpkg -x` into a prefix, and a wrapper script that runs them through the prefix's own dynamic
# loader is written to PREFIX/bin/criu. Nothing is installed system-wide.
#
# Usage: scripts/setup-criu.sh [PREFIX]   (default: .stasis/criu under the repository root)
# Prints the path of the criu to use on its last line.
#
# STASIS_CRIU_SUITE=trixie fetches Debian 13's CRIU 4.1.1 instead, and never the system's: the
# tests use it to show what stasisd does with a CRIU too old for this kernel's inet sockets.
set -euo pipefail

root=$(cd "$(dirname "$0")/.." && pwd)
prefix=$(realpath -m "${1:-$root/.stasis/criu}")
wrapper=$prefix/bin/criu
suite=${STASIS_CRIU_SUITE:-sid}
case $suite in
  sid) want=402 libnet=libnet9 ;;
  trixie) want=401 libnet=libnet1 ;;
  *) echo "setup-criu: unknown STASIS_CRIU_SUITE $suite (sid or trixie)" >&2; exit 2 ;;
esac

# CRIU's version as one number, major * 100 + minor (4.2.1 -> 402); empty if it does not run.
criu_level() {
  "$1" --version 2>/dev/null | sed -n 's/^Version: \([0-9]*\)\.\([0-9]*\).*/\1 \2/p' |
    { read -r major minor && echo $((major * 100 + minor)); }
}

if [ -x "$wrapper" ] && [ "$(criu_level "$wrapper")" -ge $want ] 2>/dev/null; then
  echo "$wrapper"; exit 0
fi
if [ "$suite" = sid ] && command -v criu >/dev/null \
  && [ "$(criu_level "$(command -v criu)")" -ge $want ] 2>/dev/null && criu check >/dev/null 2>&1; then
  command -v criu; exit 0
fi

pkgs="criu libcompel1 libprotobuf-c1 libnl-3-200 $libnet libgnutls30t64 libnftables1 libnftnl11
libmnl0 libjansson4 libxtables12 libbsd0 libmd0 libcap2 libuuid1 libc6 libp11-kit0 libidn2-0
libunistring5 libtasn1-6 libnettle8t64 libhogweed6t64 libgmp10 libffi8 libzstd1 zlib1g
libbrotli1 libedit2 libgcc-s1 libdrm2"

echo "setup-criu: fetching CRIU from Debian $suite into $prefix" >&2
# shellcheck source=scripts/debs.sh
. "$root/scripts/debs.sh"
unpack_debs "$suite" "$prefix" $pkgs
loader_wrapper "$prefix" criu "$prefix/usr/sbin/criu"
rm -rf "$prefix" && mv "$prefix.tmp" "$prefix"
"$wrapper" --version >&2
"$wrapper" check >&2
echo "$wrapper"
