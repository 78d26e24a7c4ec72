#!/usr/bin/env bash
# Run ON a GPU machine as root from the repo root with STASISD, STASIS, CRIU set (as for
# run_gpu_tests.sh); PYTHON needs PyTorch with CUDA.
#
# Idle reclaim of a CUDA job (tests/gpu/gpu_busy.py): while its GPU works and its CPU sleeps
# it is not reclaimed (NVML's per-process utilization counts as activity); once it is quiet it
# is reclaimed (GPU memory freed), and `stasis wake` brings it back with its GPU tensor intact.
set -u
W=$(mktemp -d); S="$STASIS --socket $W/sock"; PY=${PYTHON:-python3}
$STASISD --socket $W/sock --state-dir $W/state --store file://$W/store --criu $CRIU \
  --idle-tick-ms 500 >$W/d.log 2>&1 & D=$!
for _ in $(seq 100); do [ -S $W/sock ] && break; sleep 0.1; done
state() { $S status --json | $PY -c 'import json,sys; print(next(w["state"] for w in json.load(sys.stdin)["workloads"] if w["name"] == "gb"))'; }
log=$($S run --workload gb --idle-after 4s --json -- $PY tests/gpu/gpu_busy.py 14 40 |
  $PY -c 'import json,sys; print(json.load(sys.stdin)["log"])')
for _ in $(seq 600); do grep -q '^ready' $log && break; sleep 0.1; done
fails=0
# Busy on the GPU for 14 s with an idle CPU: never reclaimed.
while ! grep -q '^quiet' $log; do
  s=$(state)
  if [ "$s" != running ]; then echo "FAIL: reclaimed while the GPU was busy (state $s)"; fails=1; break; fi
  sleep 0.5
done
[ $fails = 0 ] && echo "PASS: not reclaimed while its kernels ran ($(grep -c '^burst' $log) bursts)"
# Quiet: reclaimed within the idle period and a tick or two.
for _ in $(seq 60); do [ "$(state)" = reclaimed ] && break; sleep 0.5; done
if [ "$(state)" = reclaimed ]; then echo "PASS: reclaimed once quiet"; else echo "FAIL: not reclaimed: $(state)"; fails=1; fi
nvidia-smi --query-compute-apps=pid --format=csv,noheader
$S wake gb || { echo "FAIL: wake"; fails=1; }
after_quiet() { awk '/^quiet/{q=1} q && /^burst/' $log; }
for _ in $(seq 900); do [ "$(after_quiet | wc -l)" -ge 2 ] && break; sleep 0.2; done
if [ "$(after_quiet | grep -c 'sum ok')" -ge 2 ] && ! grep -q 'sum BAD' $log; then
  echo "PASS: woken, it works on with its GPU tensor intact"
else echo "FAIL: after the wake: $(tail -3 $log)"; fails=1; grep -iE 'warn|error' $W/d.log | tail -5; fi
$S idle gb --off >/dev/null; pkill -9 -f gpu_busy.py; kill $D; wait $D
exit $fails
