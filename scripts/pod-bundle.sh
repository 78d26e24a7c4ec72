#!/usr/bin/env bash
# Builds the pod bundle: what a container mounts read-only (at /.stasis) so that stasisd can run
# CRIU inside the container's namespaces, whatever libraries the container's image has (a
# busybox or distroless image has none):
#
#   OUT/ld.so     the dynamic loader CRIU was linked for
#   OUT/lib/      every shared library CRIU loads
#   OUT/criu      CRIU itself, run as `OUT/ld.so --library-path OUT/lib OUT/criu`
#   OUT/plugins/  empty: CRIU's plugin directory (CRIU_LIBS_DIR), so that it loads no plugin
#                 from the container's root (its default, /usr/lib/criu, is the image's there)
#   (and libgcc_s in OUT/lib, which stasis-pod needs besides)
#
# stasis-pod (the container's init) and libstasis_enter_root.so (preloaded into CRIU, which starts
# with the bundle as its root: it moves CRIU into the container's root once CRIU's libraries are
# loaded) are copied in next to CRIU afterwards (deploy/kubernetes/Dockerfile
# does); stasis-nri mounts the bundle into opted-in containers (`stasis-nri --bundle OUT`).
#
# Usage: scripts/pod-bundle.sh OUT [CRIU]   (CRIU: what scripts/setup-criu.sh printed; default:
# its answer). Copies, never links: the bundle must be whole inside a container's mount.
set -euo pipefail

root=$(cd "$(dirname "$0")/.." && pwd)
out=$(realpath -m "$1")
criu=${2:-$("$root/scripts/setup-criu.sh" | tail -n 1)}

# A wrapper from setup-criu.sh names its loader, library directory and binary; a system CRIU
# is an ELF whose loader lists its libraries.
if head -c 2 "$criu" | grep -q '#!'; then
  read -r loader libdir binary < <(sed -n 's/^exec "\([^"]*\)" --library-path "\([^"]*\)" "\([^"]*\)".*/\1 \2 \3/p' "$criu")
  list=("$loader" --library-path "$libdir" --list "$binary")
else
  binary=$criu
  loader=$(readelf -l "$binary" | sed -n 's/.*Requesting program interpreter: \(.*\)]/\1/p')
  list=("$loader" --list "$binary")
fi
[ -x "$loader" ] && [ -f "$binary" ] || { echo "pod-bundle: cannot tell how $criu runs" >&2; exit 1; }

rm -rf "$out.tmp" && mkdir -p "$out.tmp/lib" "$out.tmp/plugins"
cp -L "$loader" "$out.tmp/ld.so"
cp -L "$binary" "$out.tmp/criu"
"${list[@]}" | sed -n 's/.*=> \(\/[^ ]*\) (0x.*/\1/p' | while read -r lib; do
  cp -L "$lib" "$out.tmp/lib/"
done
# stasis-pod (Rust) unwinds with libgcc_s, which CRIU itself does not load.
if [ ! -e "$out.tmp/lib/libgcc_s.so.1" ]; then
  gcc_s=${libdir:+$libdir/libgcc_s.so.1}
  [ -n "$gcc_s" ] && [ -e "$gcc_s" ] || gcc_s=$(/sbin/ldconfig -p | sed -n 's/.*libgcc_s.so.1 (libc6,x86-64) => //p' | head -n 1)
  cp -L "$gcc_s" "$out.tmp/lib/"
fi
rm -rf "$out" && mv "$out.tmp" "$out"
"$out/ld.so" --library-path "$out/lib" "$out/criu" --version >&2
echo "$out"
