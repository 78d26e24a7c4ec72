#!/usr/bin/env bash
# Notice to durable: how long after a preemption notice every spot workload is durable, for
# 1, 2 and 4 workloads of MIB (default 1024) each (bench/spot_job.py: threads, heap churn, a
# socket, 4 MiB/s rewritten), without and with a checkpoint GAP seconds (default 60) before
# the notice (what `--checkpoint-every` gives). The notice is `stasis evacuate --within 30s`,
# the same planner and evictions a cloud's notice starts (a watcher adds at most its poll
# interval). Target: with the earlier checkpoint, all durable within 0.25 of GCP's 30 s.
#
# Needs root; builds stasis (release). Usage: MIB=1024 GAP=60 COUNTS="1 2 4" bench/notice_to_durable.sh
set -euo pipefail
root=$(cd "$(dirname "$0")/.." && pwd)
mib=${MIB:-1024} gap=${GAP:-60} counts=${COUNTS:-"1 2 4"}
cargo build --release -q --manifest-path "$root/Cargo.toml" -p stasis-daemon -p stasis-cli
bin=$root/target/release
work=$(mktemp -d /var/tmp/stasis-bench.XXXXXX)
daemon=
cleanup() {
  [ -n "$daemon" ] && kill "$daemon" 2>/dev/null
  pkill -f "spot_job.py $mib" || true
  rm -rf "$work"
}
trap cleanup EXIT
"$bin/stasisd" --socket "$work/s.sock" --state-dir "$work/state" --store "file://$work/store" \
  --notices off --keep-last 0 >"$work/log" 2>&1 &
daemon=$!
stasis() { "$bin/stasis" --socket "$work/s.sock" "$@"; }
for _ in $(seq 100); do stasis status >/dev/null 2>&1 && break; sleep 0.1; done

# Starts N jobs named job-<round>-<i> and waits until each is ready.
start_jobs() {
  local round=$1 n=$2
  for i in $(seq "$n"); do
    stasis run --spot --workload "job-$round-$i" -- python3 "$root/bench/spot_job.py" "$mib" >/dev/null
  done
  for i in $(seq "$n"); do
    until grep -q '^ready' "$work/state/logs/job-$round-$i.log" 2>/dev/null; do sleep 0.2; done
  done
}

# Evacuates; prints the seconds until the last workload was durable (fails if one is not).
evacuate() {
  stasis evacuate --within 30s --json | python3 -c 'import json, sys
done = json.load(sys.stdin)["workloads"]
bad = [w["workload"] + ": " + w["error"] for w in done if not w["checkpoint"]]
assert not bad, bad
worst = max(w["durable_unix_ms"] - w["notice_unix_ms"] for w in done)
print(f"{worst / 1000:.2f}")'
}

printf '%-9s %-22s %-22s %s\n' workloads "no earlier checkpoint" "checkpoint ${gap}s before" "ratio (with / 30 s window)"
round=0
for n in $counts; do
  round=$((round + 1))
  start_jobs "$round-a" "$n"
  cold=$(evacuate)
  start_jobs "$round-b" "$n"
  for i in $(seq "$n"); do stasis checkpoint --workload "job-$round-b-$i" --leave-running >/dev/null; done
  sleep "$gap"
  warm=$(evacuate)
  ratio=$(python3 -c "print(f'{$warm / 30:.2f}')")
  printf '%-9s %-22s %-22s %s\n' "$n x ${mib} MiB" "${cold} s" "${warm} s" "$ratio (target <= 0.25)"
done
