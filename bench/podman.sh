#!/usr/bin/env bash
# stasis against Podman itself, on the same workload in one run: stasis-bench-workload holding
# MIB MiB (half random, half text-like; --churn: heap and mapping churn and scattered writes
# on each rewrite) runs once under `stasis run` and once in a Podman container (busybox image
# with the host's libraries mounted read-only, runc). Each round rewrites a tenth of both
# workloads' memory, then checkpoints both, left running (stasis: incremental, to its store;
# Podman: `container checkpoint --leave-running --export --compress zstd`), in alternating
# order; then restores both (stasis: eager restore of its checkpoint; Podman: `container
# restore --import` of its archive), again alternating. Prints each time, the medians and
# the ratios stasis / Podman. Both stores are files on the same file system.
#
# Needs root, podman, runc and /bin/busybox (scripts/test.sh installs them); builds stasis
# (release). Usage: MIB=1024 ROUNDS=3 bench/podman.sh
set -euo pipefail
root=$(cd "$(dirname "$0")/.." && pwd)
mib=${MIB:-1024} rounds=${ROUNDS:-3}
cargo build --release -q --manifest-path "$root/Cargo.toml" -p stasis-daemon -p stasis-cli -p stasis-bench
bin=$root/target/release
criu=$("$root/scripts/setup-criu.sh" | tail -n 1)
work=$(mktemp -d /var/tmp/stasis-podman.XXXXXX)
export CONTAINERS_CONF=$work/containers.conf CONTAINERS_STORAGE_CONF=$work/storage.conf
export PATH=$(dirname "$criu"):$PATH
printf '[engine]\nruntime = "runc"\n' >"$CONTAINERS_CONF"
printf '[storage]\ndriver = "overlay"\ngraphroot = "%s"\nrunroot = "%s"\n' "$work/graph" "$work/run" \
  >"$CONTAINERS_STORAGE_CONF"
daemon=
cleanup() {
  podman rm -a -f >/dev/null 2>&1 || true
  podman system reset --force >/dev/null 2>&1 || true
  [ -n "$daemon" ] && kill "$daemon" 2>/dev/null
  pkill -f "stasis-bench-workload --rss-mib $mib" || true
  rm -rf "$work"
}
trap cleanup EXIT

mkdir -p "$work/rootfs/bin" "$work/archives"
cp /bin/busybox "$work/rootfs/bin/" && ln -s busybox "$work/rootfs/bin/sh"
tar -C "$work/rootfs" -cf "$work/rootfs.tar" . && podman import -q "$work/rootfs.tar" localhost/bench >/dev/null
"$bin/stasisd" --socket "$work/s.sock" --state-dir "$work/state" --store "file://$work/store" \
  --criu "$criu" --notices off --keep-last 0 >"$work/log" 2>&1 &
daemon=$!
stasis() { "$bin/stasis" --socket "$work/s.sock" "$@"; }
for _ in $(seq 100); do stasis status >/dev/null 2>&1 && break; sleep 0.1; done

load=("$bin/stasis-bench-workload" --rss-mib "$mib" ${CHURN:+--churn})
stasis run --workload bench -- "${load[@]}" >/dev/null
podman run -d --name bench --network none --ulimit nofile=1024:1024 --ulimit nproc=4096:4096 \
  -v /usr/lib/x86_64-linux-gnu:/lib/x86_64-linux-gnu:ro -v /usr/lib64:/lib64:ro -v "$bin:$bin:ro" \
  localhost/bench "${load[@]}" >/dev/null
until grep -q '^ready' "$work/state/logs/bench.log" 2>/dev/null; do sleep 0.5; done
until podman logs bench 2>/dev/null | grep -q '^ready'; do sleep 0.5; done
container_pid() { podman inspect --format '{{.State.Pid}}' bench; }
stasis_pid() { stasis status --json | python3 -c 'import json, sys
print(next(w["pid"] for w in json.load(sys.stdin)["workloads"] if w["name"] == "bench"))'; }
# stasis-init passes the signal on to the workload; in the container it is the first process.
dirty() {
  kill -USR1 "$(stasis_pid)" "$(container_pid)"
  sleep 2
}
ms() { python3 -c "import sys; print(round((int(sys.argv[2]) - int(sys.argv[1])) / 1e6))" "$@"; }
timed() { local t0; t0=$(date +%s%N); "$@" >/dev/null; ms "$t0" "$(date +%s%N)"; }

# A first, full checkpoint each way, not measured: stasis' later ones are incremental.
stasis checkpoint --workload bench --leave-running >/dev/null
podman container checkpoint --leave-running --export "$work/archives/0.tar.zst" --compress zstd bench >/dev/null
ck_s=() ck_p=() rs_s=() rs_p=()
for r in $(seq "$rounds"); do
  dirty
  archive=$work/archives/$r.tar.zst
  one_s() { timed stasis checkpoint --workload bench --leave-running; }
  one_p() { timed podman container checkpoint --leave-running --export "$archive" --compress zstd bench; }
  if [ $((r % 2)) = 1 ]; then s=$(one_s); p=$(one_p); else p=$(one_p); s=$(one_s); fi
  ck_s+=("$s") ck_p+=("$p")
  echo "round $r: checkpoint stasis $s ms, podman $p ms ($(du -m "$archive" | cut -f1) MiB archive)"
done
id=$(stasis list --workload bench --json | python3 -c 'import json, sys; print(json.load(sys.stdin)["checkpoints"][-1]["id"])')
last=$work/archives/$rounds.tar.zst
for r in $(seq "$rounds"); do
  kill -9 "$(stasis_pid)" 2>/dev/null || true
  podman rm -f -t 0 bench >/dev/null
  sleep 1
  one_s() { timed stasis restore "$id"; }
  one_p() { timed podman container restore --import "$last" --name bench; }
  if [ $((r % 2)) = 1 ]; then s=$(one_s); p=$(one_p); else p=$(one_p); s=$(one_s); fi
  rs_s+=("$s") rs_p+=("$p")
  # Both must run again.
  kill -0 "$(stasis_pid)" && [ "$(podman inspect --format '{{.State.Running}}' bench)" = true ]
  echo "round $r: restore stasis $s ms, podman $p ms"
done
median() { printf '%s\n' "$@" | sort -n | sed -n "$(( ($# + 1) / 2 ))p"; }
python3 - "$(median "${ck_s[@]}")" "$(median "${ck_p[@]}")" "$(median "${rs_s[@]}")" "$(median "${rs_p[@]}")" "$mib" <<'PY'
import sys
cs, cp, rs, rp, mib = map(int, sys.argv[1:])
print(f"| {mib} MiB | stasis (median) | podman (median) | stasis / podman |")
print("|---|---|---|---|")
print(f"| checkpoint, left running, after 10 % rewritten | {cs} ms | {cp} ms | {cs / cp:.2f} |")
print(f"| restore | {rs} ms | {rp} ms | {rs / rp:.2f} |")
PY
