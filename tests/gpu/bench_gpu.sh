#!/usr/bin/env bash
# GPU benchmark of stasis: checkpoint and restore of a process holding N GiB of device memory
# (stasis-gpu-memtest --hold), through a real stasisd and CRIU, for each N in $SIZES; and the
# device-to-host copy bandwidth of the same GPU measured with PyTorch (pinned host memory), the
# reference for the GPU phase of a checkpoint. Run ON a GPU machine as root from the repo root:
#
#   STASISD=... STASIS=... CRIU=... GPU_MEMTEST=... [SIZES="1 8 32"] bash tests/gpu/bench_gpu.sh
#
# Prints one Markdown table row per size. The store is on disk ($WORK), restore scratch images
# in tmpfs (/dev/shm) so a 32 GiB run fits the disk.
set -u
: "${STASISD:?}" "${STASIS:?}" "${CRIU:?}" "${GPU_MEMTEST:?}"
SIZES=${SIZES:-"1 8 32"}
PYTHON=${PYTHON:-python3}
WORK=$(mktemp -d /tmp/stasis-gpubench.XXXXXX)
STATE=$(mktemp -d /dev/shm/stasis-gpubench.XXXXXX)
SOCK=$WORK/stasisd.sock
cli() { "$STASIS" --socket "$SOCK" "$@"; }
field() { "$PYTHON" -c "import json,sys; d=json.load(sys.stdin); print($1)"; }
cleanup() {
  cli status --json 2>/dev/null | "$PYTHON" -c 'import json,sys; [print(w["pid"]) for w in json.load(sys.stdin)["workloads"] if w["running"]]' | xargs -r kill -9 2>/dev/null
  [ -n "${DAEMON:-}" ] && kill "$DAEMON" 2>/dev/null && wait "$DAEMON" 2>/dev/null
  rm -rf "$WORK" "$STATE"
}
trap cleanup EXIT

echo "## device-to-host bandwidth"
D2H=$("$PYTHON" - <<'PY'
import torch, time
n = 4 << 30
src = torch.empty(n, dtype=torch.uint8, device="cuda")
dst = torch.empty(n, dtype=torch.uint8, pin_memory=True)
dst.copy_(src); torch.cuda.synchronize()
t = time.perf_counter()
for _ in range(3):
    dst.copy_(src, non_blocking=True)
torch.cuda.synchronize()
print(f"{3 * n / (time.perf_counter() - t) / 1e9:.1f}")
PY
)
echo "D2H (pinned, 4 GiB x3): ${D2H} GB/s"

"$STASISD" --socket "$SOCK" --state-dir "$STATE" --store "file://$WORK/store" --criu "$CRIU" \
  --keep-last 0 --gc-grace-secs 0 >"$WORK/stasisd.log" 2>&1 &
DAEMON=$!
for _ in $(seq 100); do [ -S "$SOCK" ] && break; sleep 0.1; done
echo
echo "| GiB | gpu lock ms | gpu checkpoint ms | GPU phase GB/s | vs D2H | frozen ms | durable ms | stored GB | restore ms | gpu restore ms | checksum |"
echo "|---|---|---|---|---|---|---|---|---|---|---|"
for gib in $SIZES; do
  name=gpu$gib
  out=$(cli run --workload "$name" --json -- "$GPU_MEMTEST" --gib "$gib" --hold --period-ms 2000) || { echo "run failed"; break; }
  log=$(echo "$out" | field 'd["log"]')
  for _ in $(seq 600); do grep -q '^ready' "$log" && break; sleep 0.2; done
  ready=$(grep -m1 '^ready' "$log" | sed 's/.*checksum=//')
  ck=$(cli checkpoint --workload "$name" --json) || { echo "checkpoint failed: $ck"; tail -20 "$WORK/stasisd.log"; break; }
  id=$(echo "$ck" | field 'd["id"]')
  read -r lock gck bytes frozen durable up < <(echo "$ck" | field '" ".join(str(d["stats"][k]) for k in ["gpu_lock_ms","gpu_checkpoint_ms","gpu_bytes","frozen_ms","durable_ms","bytes_uploaded"])')
  rs=$(cli restore "$id" --json) || { echo "restore failed: $rs"; tail -20 "$WORK/stasisd.log"; break; }
  read -r rms grms < <(echo "$rs" | field '" ".join(str(d["stats"][k]) for k in ["restore_ms","gpu_restore_ms"])')
  lines=$(wc -l <"$log")
  for _ in $(seq 300); do [ "$(tail -n +$((lines + 1)) "$log" | grep -c '^verify')" -gt 0 ] && break; sleep 0.2; done
  after=$(tail -n +$((lines + 1)) "$log" | grep -m1 '^verify' | sed 's/.*checksum=//')
  verdict=$([ "$after" = "$ready" ] && echo "same" || echo "DIFFERENT ($ready vs $after)")
  bw=$("$PYTHON" -c "print(f'{$bytes / max($gck, 1) / 1e6:.1f}')")
  ratio=$("$PYTHON" -c "print(f'{$bw / $D2H:.2f}')")
  echo "| $gib | $lock | $gck | $bw | $ratio | $frozen | $durable | $("$PYTHON" -c "print(f'{$up / 1e9:.2f}')") | $rms | $grms | $verdict |"
  cli status --json | field '" ".join(str(w["pid"]) for w in d["workloads"] if w["running"])' | xargs -r kill -9
  sleep 1
  cli delete "$id" >/dev/null && cli gc >/dev/null
done
