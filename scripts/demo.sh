#!/usr/bin/env bash
# The stasis demo: checkpoint a running job to the local store, kill it, restore it, and watch
# it carry on from where it was; then once more with a hot (lazy) restore. Builds everything
# and installs CRIU 4.2 if needed (under .stasis/, without touching system packages). Needs
# root (CRIU does).
set -euo pipefail
root=$(cd "$(dirname "$0")/.." && pwd)
cd "$root"
[ "$(id -u)" = 0 ] || { echo "demo: run as root (CRIU needs it)" >&2; exit 1; }

say() { printf '\n\033[1m== %s\033[0m\n' "$*"; }

say "building"
cargo build --release --workspace --quiet
criu=$(scripts/setup-criu.sh | tail -n 1)
demo=$root/.stasis/demo
rm -rf "$demo" && mkdir -p "$demo"
sock=$demo/stasisd.sock
stasis() { target/release/stasis --socket "$sock" "$@"; }

say "starting stasisd (store: file://$demo/store, CRIU: $criu)"
target/release/stasisd --socket "$sock" --state-dir "$demo/state" --store "file://$demo/store" \
  --criu "$criu" >"$demo/stasisd.log" 2>&1 &
daemon=$!
cleanup() {
  stasis status --json 2>/dev/null | python3 -c 'import json,sys; [print(w["pid"]) for w in json.load(sys.stdin)["workloads"] if w["running"]]' \
    | xargs -r kill -9 2>/dev/null || true
  kill "$daemon" 2>/dev/null && wait "$daemon" 2>/dev/null || true
}
trap cleanup EXIT
for _ in $(seq 100); do [ -S "$sock" ] && break; sleep 0.1; done
[ -S "$sock" ] || { cat "$demo/stasisd.log"; exit 1; }
stasis status

say "starting a workload that counts and serves its progress over HTTP"
port=$(python3 -c 'import socket; s = socket.socket(); s.bind(("127.0.0.1", 0)); print(s.getsockname()[1])')
metrics() { python3 -c "import urllib.request; print(urllib.request.urlopen('http://127.0.0.1:$port/').read().decode().strip())"; }
stasis run --workload demo -- python3 -u scripts/demo_workload.py "$port"
log=$demo/state/logs/demo.log
sleep 3
tail -n 3 "$log"
echo "its HTTP endpoint says: $(metrics)"

say "checkpointing it (it is stopped once the checkpoint is stored)"
stasis checkpoint --workload demo
echo "last lines before the checkpoint:"
tail -n 2 "$log"
before=$(tail -n 1 "$log")
stasis list

say "the job is gone; restoring it from the store"
sleep 1
stasis restore --workload demo
sleep 2
echo "log after the restore (it continues from '$before', not from step 1):"
grep -A 4 -F "$before" "$log" | head -n 6
echo "its HTTP listener came back too: $(metrics)"

say "checkpointing again, then a hot restore: the job runs before its memory is back"
stasis checkpoint --workload demo
before=$(tail -n 1 "$log")
sleep 1
stasis restore --workload demo --lazy
sleep 2
echo "log after the hot restore (it continues from '$before'):"
grep -A 4 -F "$before" "$log" | head -n 6

say "demo done"
