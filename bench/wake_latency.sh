#!/usr/bin/env bash
# Wake latency of idle reclaim: a Jupyter kernel holding MIB (default 2048) of random memory
# is reclaimed after 3 s idle, then a new client connects; the time from its connection to
# the kernel's first answer is the wake latency (target: at most 1 s). R rounds (default 3).
# For scale, the same checkpoint is then restored eagerly (an eviction and `stasis restore`),
# and the ratio wake / eager restore is printed.
#
# Needs root and scripts/test.sh's venv (ipykernel, jupyter_client); builds stasis (release).
# Usage: MIB=2048 R=3 bench/wake_latency.sh
set -euo pipefail
root=$(cd "$(dirname "$0")/.." && pwd)
mib=${MIB:-2048} rounds=${R:-3}
python=$root/.stasis/venv/bin/python
cargo build --release -q --manifest-path "$root/Cargo.toml" -p stasis-daemon -p stasis-cli
bin=$root/target/release
work=$(mktemp -d)
pids=()
cleanup() {
  "$bin/stasis" --socket "$work/s.sock" idle kernel --off >/dev/null 2>&1 || true
  kill "${pids[@]}" 2>/dev/null || true
  pkill -f "ipykernel_launcher -f $work" || true
  rm -rf "$work"
}
trap cleanup EXIT
"$bin/stasisd" --socket "$work/s.sock" --state-dir "$work/state" --store "file://$work/store" \
  --keep-last 0 >"$work/log" 2>&1 &
pids+=($!)
stasis() { "$bin/stasis" --socket "$work/s.sock" "$@"; }
for _ in $(seq 100); do stasis status >/dev/null 2>&1 && break; sleep 0.1; done
ports=$(python3 -c 'import socket
s = [socket.socket() for _ in range(5)]
[x.bind(("127.0.0.1", 0)) for x in s]
print(" ".join(str(x.getsockname()[1]) for x in s))')
read -r shell iopub stdin control hb <<<"$ports"
cat >"$work/kernel.json" <<JSON
{"ip": "127.0.0.1", "transport": "tcp", "signature_scheme": "hmac-sha256", "key": "bench",
 "kernel_name": "python3", "shell_port": $shell, "iopub_port": $iopub, "stdin_port": $stdin,
 "control_port": $control, "hb_port": $hb}
JSON
mkdir -p "$work/ipython/profile_default"
stasis run --workload kernel -- "$python" -m ipykernel_launcher -f "$work/kernel.json" \
  --ipython-dir="$work/ipython" >/dev/null
"$python" "$root/bench/wake_kernel.py" fill "$work/kernel.json" "$mib"
stasis idle kernel --after 3s >/dev/null
state() { stasis status --json | python3 -c 'import json, sys
print(next(w["state"] for w in json.load(sys.stdin)["workloads"] if w["name"] == "kernel"))'; }
wakes=()
for round in $(seq "$rounds"); do
  until [ "$(state)" = reclaimed ]; do sleep 0.2; done
  ms=$("$python" "$root/bench/wake_kernel.py" probe "$work/kernel.json")
  wakes+=("$ms")
  echo "round $round: wake latency $ms ms (kernel holding $mib MiB)"
done
stasis idle kernel --off >/dev/null
until [ "$(state)" = running ]; do sleep 0.2; done
stasis checkpoint --workload kernel >/dev/null
start=$(date +%s%N)
stasis restore --workload kernel >/dev/null
eager=$(( ($(date +%s%N) - start) / 1000000 ))
median=$(printf '%s\n' "${wakes[@]}" | sort -n | sed -n "$(( (${#wakes[@]} + 1) / 2 ))p")
echo "eager restore of the same kernel: $eager ms"
python3 -c "print(f'median wake {$median} ms (target <= 1000 ms); wake / eager restore = {$median / $eager:.2f}')"
