# Sourced by the setup scripts: fetches Debian packages of any suite into a private prefix,
# without touching the system's packages.
#
# unpack_debs SUITE PREFIX PACKAGE...
#   downloads the packages (exactly those named: no dependency resolution) from Debian SUITE
#   with apt-get into a temporary directory and unpacks them with `dpkg -x` into PREFIX.tmp;
#   the caller moves PREFIX.tmp into place once it has checked the result.
# loader_wrapper PREFIX NAME PROGRAM
#   writes PREFIX.tmp/bin/NAME, a script that runs PROGRAM (a path under PREFIX) through the
#   prefix's own dynamic loader and libraries, so that a program built for a newer libc runs.
unpack_debs() {
  local suite=$1 prefix=$2
  shift 2
  local work
  work=$(mktemp -d)
  mkdir -p "$work/lists/partial" "$work/debs" "$work/etc"
  echo "deb http://deb.debian.org/debian $suite main" >"$work/etc/sources.list"
  local apt_opts=(-o "Dir::Etc::SourceList=$work/etc/sources.list" -o "Dir::Etc::SourceParts=-"
    -o "Dir::State::Lists=$work/lists" -o "Dir::Cache::Archives=$work/debs"
    -o "APT::Get::List-Cleanup=0")
  apt-get "${apt_opts[@]}" -qq update >&2
  (cd "$work/debs" && apt-get "${apt_opts[@]}" -qq download "$@" >&2)
  rm -rf "$prefix.tmp" && mkdir -p "$prefix.tmp/bin"
  for deb in "$work"/debs/*.deb; do dpkg -x "$deb" "$prefix.tmp"; done
  rm -rf "$work"
}

loader_wrapper() {
  local prefix=$1 name=$2 program=$3
  local libdir=$prefix/usr/lib/x86_64-linux-gnu
  cat >"$prefix.tmp/bin/$name" <<WRAP
#!/bin/sh
exec "$libdir/ld-linux-x86-64.so.2" --library-path "$libdir" "$program" "\$@"
WRAP
  chmod +x "$prefix.tmp/bin/$name"
}
