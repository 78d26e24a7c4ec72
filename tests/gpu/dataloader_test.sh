#!/usr/bin/env bash
# Run ON a GPU machine as root from the repo root with STASISD, STASIS, CRIU set (as for
# run_gpu_tests.sh).
#
# DataLoader trees on a real GPU: fork-started workers are refused before anything is frozen
# (and keep running); spawn-started workers are checkpointed with the trainer and the restored
# run prints the same losses as an uninterrupted one.
set -u
W=$(mktemp -d); S="$STASIS --socket $W/sock"; PY=${PYTHON:-python3}
field() { $PY -c "import json,sys; print(json.load(sys.stdin)$1)"; }
$STASISD --socket $W/sock --state-dir $W/state --store file://$W/store --criu $CRIU >$W/d.log 2>&1 & D=$!
for _ in $(seq 100); do [ -S $W/sock ] && break; sleep 0.1; done
killall_w() { $S status --json | $PY -c 'import json,sys; [print(w["pid"]) for w in json.load(sys.stdin)["workloads"] if w["running"]]' | while read p; do pkill -9 -P $p; kill -9 $p; done; }
waitstep() { for _ in $(seq 600); do grep -q "^step $2 " $1 && return 0; sleep 0.1; done; return 1; }
# fork: refused
log=$($S run --workload fk --json -- $PY tests/gpu/dataloader.py --start-method fork | field '["log"]')
waitstep $log 10 || { echo "FAIL: fork run did not start"; tail $log; }
$S checkpoint --workload fk --json; echo "fork checkpoint rc=$?"
n1=$(grep -c ^step $log); sleep 2; n2=$(grep -c ^step $log)
[ $n2 -gt $n1 ] && echo "PASS: fork-worker tree refused and still training ($n1 -> $n2 steps)" || echo "FAIL: fork tree not running after refusal"
killall_w; sleep 1
# spawn: reference run, then checkpointed run
ref=$($S run --workload ref --json -- $PY tests/gpu/dataloader.py --start-method spawn --steps 40 | field '["log"]')
waitstep $ref 40 || echo "reference did not reach 40"
log=$($S run --workload sp --json -- $PY tests/gpu/dataloader.py --start-method spawn --steps 40 | field '["log"]')
waitstep $log 15
ck=$($S checkpoint --workload sp --json) || { echo "FAIL: spawn checkpoint failed"; tail -5 $W/d.log; }
echo "$ck" | cut -c1-400; echo
before=$(grep -c ^step $log)
rs=$($S restore --workload sp --json) || { echo "FAIL: spawn restore failed"; }
echo "$rs" | cut -c1-300; echo
waitstep $log 40 || { echo "restored run did not reach 40"; tail -5 $log; grep -i error $W/d.log | tail -5; }
[ -n "$rs" ] || echo "FAIL: no restore happened"
if [ -n "$rs" ] && diff <(grep ^step $ref | head -40) <(grep ^step $log | awk '!seen[$2]++' | head -40) >/dev/null; then echo "PASS: spawn DataLoader tree: losses 1..40 identical across checkpoint/restore"; else echo "FAIL: losses differ"; diff <(grep ^step $ref | head -40) <(grep ^step $log | awk '!seen[$2]++' | head -40) | head; fi
killall_w; kill $D; wait $D
