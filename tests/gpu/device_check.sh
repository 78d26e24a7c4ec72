#!/usr/bin/env bash
# The whole GPU device check of stasis, as one run on a GPU machine with a time budget: what a
# session lent a GPU for a few minutes runs, and what it reads afterwards (one report).
#
# Prepare on a machine without a GPU (it builds, and needs the package registries the GPU
# machine lacks):
#
#   tests/gpu/bundle.sh          # release binaries and CRIU's prefix into .gpu-bundle/
#
# then on the GPU machine, as root, from the repository root:
#
#   bash tests/gpu/device_check.sh [SECTION...]
#
# Sections, run in this order (all of them when none is named); each is skipped, saying so,
# when the budget left is below its estimate, and stopped at its own time limit:
#
#   env         driver version; whether the driver has the custom-storage checkpoint API
#               (CUDA 13.4); soft-dirty tracking, transparent huge pages, userfaultfd; criu check
#   e2e         run_gpu_tests.sh: memtest evicted and left running, PyTorch losses (eager)
#   bandwidth   the GPU phase alone (stasis-gpu-probe on a memtest of BW_GIB GiB): its time and
#               the target's page faults during cuCheckpointProcessCheckpoint, first and second
#               checkpoint of one process (host copy not yet faulted in, then faulted in), with
#               transparent huge pages `madvise` and `always`; beside it PyTorch's D2H copy into
#               pinned, fresh pageable and faulted-in pageable memory
#   incremental a job that rewrites CHURN_GIB of its device memory between two checkpoints left
#               running: the second upload against the bytes changed (target <= 1.2x); then
#               evicted and restored, both buffers verified
#   kill        kill -9 of stasisd in the GPU phase, during CRIU's dump and during the upload of
#               an eviction; after a restart the job runs on or restores, never CUDA-locked
#   lazy        run_gpu_tests.sh's evicted memtest with a lazy restore
#   container   container_test.sh: the memtest in a container (namespaces of its own, stasis-pod
#               its init, the pod bundle mounted; no container runtime), evicted through its
#               preStop hook and restored into another, the CUDA phase made inside each
#   bench       bench_gpu.sh at BENCH_SIZES GiB (1 8): GPU phase GB/s against pinned D2H, frozen,
#               durable and restore times
#   idle        idle_test.sh: idle reclaim of a CUDA job through NVML
#   dataloader  dataloader_test.sh: DataLoader worker trees
#
# Settings: BUNDLE (.gpu-bundle), BUDGET_S (seconds for everything, 500), OUT (where the report
# and logs go; a temporary directory otherwise), BW_GIB (4), CHURN_GIB (0.25), PYTHON (python3).
# The report is $OUT/report.md; every section's output is in $OUT/<section>.log, and its last
# lines in the report. Without a GPU every section that needs one says so and the run goes on.
set -u

root=$(cd "$(dirname "$0")/../.." && pwd)
cd "$root" || exit 2
BUNDLE=$(realpath -m "${BUNDLE:-.gpu-bundle}")
BUDGET_S=${BUDGET_S:-500}
OUT=${OUT:-$(mktemp -d /tmp/device-check.XXXXXX)}
BW_GIB=${BW_GIB:-4}
CHURN_GIB=${CHURN_GIB:-0.25}
PYTHON=${PYTHON:-python3}
REPORT=$OUT/report.md
export OUT
STASISD=$BUNDLE/stasisd
STASIS=${STASIS:-$BUNDLE/stasis}
MEMTEST=$BUNDLE/stasis-gpu-memtest
PROBE=$BUNDLE/stasis-gpu-probe
CRIU=$BUNDLE/criu/bin/criu
export STASISD STASIS CRIU PYTHON GPU_MEMTEST=$MEMTEST GPU_PROBE=$PROBE

note() { printf '%s\n' "$*" >>"$REPORT"; }
say() { printf '%s %s\n' "$(date +%H:%M:%S)" "$*"; }
have_gpu() { nvidia-smi -L >/dev/null 2>&1; }
alive() { [ -d "/proc/$1" ] && ! grep -q '^State:[[:space:]]*Z' "/proc/$1/status" 2>/dev/null; }
minflt() { awk '{print $10}' "/proc/$1/stat" 2>/dev/null; }
field() { "$PYTHON" -c "import json,sys; d=json.load(sys.stdin); print($1)"; }
# probe_ms WHAT PID: runs `stasis-gpu-probe WHAT PID`, prints its milliseconds (or FAILED).
probe_ms() { "$PROBE" "$1" "$2" 2>&1 | sed -n "s/^$1 ok in \([0-9.]*\) ms.*/\1/p;s/^$1 FAILED.*/FAILED/p"; }
cuda_state() { "$PROBE" state "$1" 2>&1 | sed -n "s/^pid $1: //p"; }

# The CRIU wrapper names its prefix by absolute path: write it for where the bundle is now.
criu_wrapper() {
    local lib=$BUNDLE/criu/usr/lib/x86_64-linux-gnu
    mkdir -p "$BUNDLE/criu/bin"
    printf '#!/bin/sh\nexec "%s/ld-linux-x86-64.so.2" --library-path "%s" "%s/criu/usr/sbin/criu" "$@"\n' \
        "$lib" "$lib" "$BUNDLE" >"$CRIU"
    chmod +x "$CRIU"
}

# --- a daemon of one section ---------------------------------------------------------------
# daemon_start DIR [FLAGS...]: stasisd with its socket, state and store under DIR.
daemon_start() {
    local dir=$1
    shift
    mkdir -p "$dir"
    "$STASISD" --socket "$dir/sock" --state-dir "$dir/state" --store "file://$dir/store" --criu "$CRIU" \
        "$@" >>"$dir/stasisd.log" 2>&1 </dev/null &
    DAEMON=$!
    for _ in $(seq 150); do
        [ -S "$dir/sock" ] && "$STASIS" --socket "$dir/sock" status >/dev/null 2>&1 && return 0
        alive "$DAEMON" || break
        sleep 0.1
    done
    echo "stasisd did not start:"
    tail -20 "$dir/stasisd.log"
    return 1
}
daemon_stop() {
    [ -n "${DAEMON:-}" ] || return 0
    kill "$DAEMON" 2>/dev/null
    for _ in $(seq 100); do alive "$DAEMON" || break; sleep 0.1; done
    kill -9 "$DAEMON" 2>/dev/null
    wait "$DAEMON" 2>/dev/null
    DAEMON=
}
# wait_for FILE REGEX SECONDS: waits until a line of FILE matches.
wait_for() {
    local deadline=$((SECONDS + $3))
    until grep -qE "$2" "$1" 2>/dev/null; do
        [ "$SECONDS" -ge "$deadline" ] && return 1
        sleep 0.05
    done
}
# verify_after LOG SKIP SECONDS: the first `verify` line after line SKIP.
verify_after() {
    local deadline=$((SECONDS + $3)) line
    while [ "$SECONDS" -lt "$deadline" ]; do
        line=$(tail -n +"$(($2 + 1))" "$1" | grep -m1 '^verify')
        [ -n "$line" ] && { printf '%s\n' "$line"; return 0; }
        sleep 0.2
    done
    return 1
}
checksum_of() { sed -n 's/.*checksum=\([0-9a-f]*\).*/\1/p' <<<"$1"; }
# The CUDA process of a workload: the first child of its init.
cuda_child() {
    local c
    c=$(awk '{print $1}' /proc/"$1"/task/*/children 2>/dev/null | head -1)
    echo "${c:-$1}"
}

# --- sections --------------------------------------------------------------------------------
sec_env() {
    echo "GPU: $(nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv,noheader 2>&1 | head -3)"
    "$PROBE" gpus 2>&1 | sed 's/^/probe: /'
    echo "kernel $(uname -r), $(nproc) CPUs, $(awk '/MemTotal/ {print int($2 / 1048576)}' /proc/meminfo) GiB"
    echo "THP enabled: $(cat /sys/kernel/mm/transparent_hugepage/enabled 2>&1); defrag: $(cat /sys/kernel/mm/transparent_hugepage/defrag 2>&1)"
    "$PYTHON" - <<'PY'
import ctypes
try:
    lib = ctypes.CDLL("libcuda.so.1")
except OSError as e:
    print(f"libcuda: {e}")
else:
    names = ["cuCheckpointProcessLock", "cuCheckpointProcessCheckpoint", "cuCheckpointProcessRestore",
             "cuCheckpointProcessUnlock", "cuCheckpointProcessGetState", "cuCheckpointOperationComplete"]
    for n in names:
        print(f"libcuda {n}: {'present' if hasattr(lib, n) else 'absent'}")
    v = ctypes.c_int()
    lib.cuDriverGetVersion(ctypes.byref(v))
    print(f"cuDriverGetVersion: {v.value}")
PY
    "$PYTHON" - <<'PY'
import ctypes, mmap, struct
m = mmap.mmap(-1, 4096)
m[0:1] = b"x"
addr = ctypes.addressof(ctypes.c_char.from_buffer(m))
def bit55():
    with open("/proc/self/pagemap", "rb") as f:
        f.seek(addr // 4096 * 8)
        return (struct.unpack("Q", f.read(8))[0] >> 55) & 1
try:
    with open("/proc/self/clear_refs", "w") as f:
        f.write("4")
except OSError as e:
    print(f"soft-dirty: absent (clear_refs 4: {e.strerror})")
    raise SystemExit
cleared = bit55()
m[0:1] = b"y"
written = bit55()
print("soft-dirty: works" if (cleared, written) == (0, 1)
      else f"soft-dirty: absent (bit 55 after clear {cleared}, after a write {written})")
PY
    for f in /proc/config.gz "/boot/config-$(uname -r)"; do
        [ -r "$f" ] && echo "$f: $( (zcat -f "$f" | grep -E 'CONFIG_MEM_SOFT_DIRTY|CONFIG_USERFAULTFD=') 2>&1 | tr '\n' ' ')"
    done
    echo "userfaultfd: /dev/userfaultfd $([ -e /dev/userfaultfd ] && echo present || echo absent), vm.unprivileged_userfaultfd=$(cat /proc/sys/vm/unprivileged_userfaultfd 2>&1)"
    echo "criu: $("$CRIU" --version 2>&1 | head -1); check: $("$CRIU" check 2>&1 | tail -1)"
}

sec_e2e() { MEMTEST_GIB=2 bash tests/gpu/run_gpu_tests.sh; }
sec_lazy() { LAZY=1 MEMTEST_GIB=2 TESTS=memtest-evict bash tests/gpu/run_gpu_tests.sh; }
sec_idle() { bash tests/gpu/idle_test.sh; }
sec_dataloader() { bash tests/gpu/dataloader_test.sh; }
sec_bench() { SIZES=${BENCH_SIZES:-"1 8"} GPU_MEMTEST=$MEMTEST bash tests/gpu/bench_gpu.sh; }

# D2H reference copies of N GiB: pinned, fresh pageable (first touch in the copy), pageable
# already faulted in.
d2h_reference() {
    "$PYTHON" - "$1" <<'PY'
import sys, time, torch
n = int(float(sys.argv[1]) * (1 << 30))
src = torch.empty(n, dtype=torch.uint8, device="cuda")
src.fill_(7)
torch.cuda.synchronize()
def copy(dst):
    t = time.perf_counter()
    dst.copy_(src)
    torch.cuda.synchronize()
    return n / (time.perf_counter() - t) / 1e9
pinned = torch.empty(n, dtype=torch.uint8, pin_memory=True)
copy(pinned)
fresh = torch.empty(n, dtype=torch.uint8)
first = copy(fresh)
print(f"D2H GB/s: pinned {copy(pinned):.1f}, pageable fresh {first:.1f}, pageable faulted-in {copy(fresh):.1f}")
PY
}

sec_bandwidth() {
    local thp_file=/sys/kernel/mm/transparent_hugepage/enabled thp_was pid log ready round f0 f1 ck rs ul hp
    thp_was=$(sed -n 's/.*\[\(.*\)\].*/\1/p' "$thp_file")
    echo "| THP | D2H reference | checkpoint | ms | GB/s | target faults | AnonHugePages after | restore ms | unlock ms |"
    echo "|---|---|---|---|---|---|---|---|---|"
    for thp in madvise always; do
        echo "$thp" >"$thp_file" 2>/dev/null || { echo "cannot set THP to $thp"; continue; }
        local ref
        ref=$(d2h_reference "$BW_GIB" 2>&1 | tail -1)
        log=$(mktemp)
        "$MEMTEST" --gib "$BW_GIB" --hold --period-ms 2000 >"$log" 2>&1 &
        pid=$!
        wait_for "$log" '^ready' 120 || { echo "memtest not ready: $(tail -3 "$log")"; kill -9 "$pid"; continue; }
        ready=$(grep -m1 '^ready' "$log")
        for round in first second; do
            f0=$(minflt "$pid")
            [ "$(probe_ms lock "$pid")" = FAILED ] && { echo "lock failed"; break; }
            ck=$(probe_ms checkpoint "$pid")
            f1=$(minflt "$pid")
            hp=$(awk '/AnonHugePages/ {print int($2 / 1024) " MiB"}' "/proc/$pid/smaps_rollup")
            rs=$(probe_ms restore "$pid")
            ul=$(probe_ms unlock "$pid")
            echo "| $thp | $ref | $round | $ck | $("$PYTHON" -c "print(f'{$BW_GIB * 1.073741824 / max(float('$ck' or 'nan'), 1e-9) * 1000:.2f}')" 2>/dev/null) | $((f1 - f0)) | $hp | $rs | $ul |"
        done
        local n v
        n=$(wc -l <"$log")
        v=$(verify_after "$log" "$n" 10)
        if [ "$(checksum_of "$v")" = "$(checksum_of "$ready")" ]; then
            echo "PASS: bandwidth: THP $thp: the memtest verifies after both cycles"
        else
            echo "FAIL: bandwidth: THP $thp: after both cycles: ${v:-no verify} ($ready)"
        fi
        kill -9 "$pid" 2>/dev/null
        wait "$pid" 2>/dev/null
        rm -f "$log"
    done
    echo "$thp_was" >"$thp_file" 2>/dev/null
}

sec_incremental() {
    local d=/tmp/dc-incr W log pid ready sum ck1 ck2 ck3 up2 total2 gpu2 n v
    rm -rf "$d"
    daemon_start "$d" --keep-last 0 || return 1
    W="$STASIS --socket $d/sock"
    ready=$($W run --workload churn --json -- "$MEMTEST" --gib 2 --hold --churn-gib "$CHURN_GIB" --period-ms 300)
    pid=$(field 'd["pid"]' <<<"$ready")
    log=$(field 'd["log"]' <<<"$ready")
    wait_for "$log" '^churn ok' 120 || { echo "FAIL: memtest not churning: $(tail -3 "$log")"; daemon_stop; return 1; }
    sum=$(checksum_of "$(grep -m1 '^ready' "$log")")
    ck1=$($W checkpoint --workload churn --leave-running --json) || { echo "FAIL: first checkpoint: $ck1"; daemon_stop; return 1; }
    n=$(grep -c '^churn ok' "$log")
    for _ in $(seq 100); do [ "$(grep -c '^churn ok' "$log")" -ge $((n + 2)) ] && break; sleep 0.1; done
    ck2=$($W checkpoint --workload churn --leave-running --json) || { echo "FAIL: second checkpoint: $ck2"; daemon_stop; return 1; }
    echo "first:  $(field 'd["stats"]' <<<"$ck1")"
    echo "second: $(field 'd["stats"]' <<<"$ck2")"
    up2=$(field 'd["stats"]["bytes_uploaded"]' <<<"$ck2")
    total2=$(field 'd["stats"]["bytes_total"]' <<<"$ck2")
    gpu2=$(field 'd["stats"]["gpu_bytes"]' <<<"$ck2")
    local changed
    changed=$("$PYTHON" -c "print(int($CHURN_GIB * (1 << 30)))")
    echo "RESULT incremental: second upload $up2 B of $total2 B (device $gpu2 B), changed on the device $changed B: $("$PYTHON" -c "print(f'{$up2 / $changed:.2f}')")x (target <= 1.2x)"
    $W show "$(field 'd["id"]' <<<"$ck1")" --json >"$OUT/incr-show1.json" 2>&1
    $W show "$(field 'd["id"]' <<<"$ck2")" --json >"$OUT/incr-show2.json" 2>&1
    # Evicted and restored: both buffers verified.
    ck3=$($W checkpoint --workload churn --json) || { echo "FAIL: eviction: $ck3"; daemon_stop; return 1; }
    echo "eviction: $(field 'd["stats"]' <<<"$ck3")"
    for _ in $(seq 100); do alive "$pid" || break; sleep 0.1; done
    n=$(wc -l <"$log")
    $W restore --workload churn --json >/dev/null || { echo "FAIL: restore"; tail -20 "$d/stasisd.log"; daemon_stop; return 1; }
    v=$(verify_after "$log" "$n" 60)
    for _ in $(seq 50); do [ "$(tail -n +"$((n + 1))" "$log" | grep -c '^churn')" -ge 2 ] && break; sleep 0.2; done
    if [ "$(checksum_of "$v")" = "$sum" ] && ! tail -n +"$((n + 1))" "$log" | grep -q FAILED \
        && [ "$(tail -n +"$((n + 1))" "$log" | grep -c '^churn ok')" -ge 2 ]; then
        echo "PASS: incremental: restored after the eviction, held and churned buffers verified"
    else
        echo "FAIL: incremental restore: $v / $(tail -n +"$((n + 1))" "$log" | head -5 | tr '\n' ' ')"
    fi
    kill -9 "$pid" 2>/dev/null
    daemon_stop
}

# One kill of stasisd during an eviction, at POINT: gpu | dump | upload.
kill_at() {
    local point=$1 d=/tmp/dc-kill-$1 W out pid cpid log sum cli n v before after state
    rm -rf "$d"
    daemon_start "$d" || return 1
    W="$STASIS --socket $d/sock"
    out=$($W run --workload "k$point" --json -- "$MEMTEST" --gib 3 --hold --period-ms 300)
    pid=$(field 'd["pid"]' <<<"$out")
    log=$(field 'd["log"]' <<<"$out")
    wait_for "$log" '^verify ok' 120 || { echo "FAIL: kill $point: memtest not ready"; daemon_stop; return 1; }
    sum=$(checksum_of "$(grep -m1 '^ready' "$log")")
    cpid=$(cuda_child "$pid")
    $W checkpoint --workload "k$point" --json >"$d/ck.json" 2>&1 &
    cli=$!
    case $point in
        gpu) wait_for "$d/stasisd.log" 'dumping' 30 && sleep 0.5 ;;
        dump)
            wait_for "$d/stasisd.log" 'GPU state moved' 60
            for _ in $(seq 100); do pgrep -f swrk >/dev/null && break; sleep 0.02; done
            sleep 0.2
            ;;
        upload)
            wait_for "$d/stasisd.log" 'GPU state moved' 60
            for _ in $(seq 200); do pgrep -f swrk >/dev/null && break; sleep 0.02; done
            for _ in $(seq 600); do pgrep -f swrk >/dev/null || break; sleep 0.02; done
            ;;
    esac
    # (No CUDA state asked for before the kill: the driver answers only once a checkpoint
    # under way is done, which would move the kill past the GPU phase.)
    before="GPU phase $(grep -q 'GPU state moved' "$d/stasisd.log" && echo done || echo 'under way')"
    grep -q 'checkpoint stored' "$d/stasisd.log" && before="$before; the checkpoint was already stored (point missed)"
    kill -9 "$DAEMON"
    wait "$DAEMON" 2>/dev/null
    kill "$cli" 2>/dev/null
    sleep 0.5
    after=$(cuda_state "$cpid")
    n=$(wc -l <"$log")
    daemon_start "$d" || return 1
    sleep 1
    if alive "$pid"; then
        state=$(cuda_state "$cpid")
        v=$(verify_after "$log" "$n" 20)
        if [ "$state" = running ] && [ "$(checksum_of "$v")" = "$sum" ]; then
            echo "PASS: kill $point: the job runs on (at the kill: $before; CUDA state after: $after; after the restart: $state)"
        else
            echo "FAIL: kill $point: CUDA state $state, verify '${v:-none}' (at the kill: $before; after: $after)"
            grep -iE 'giving back|held|GPU|warn|error' "$d/stasisd.log" | tail -8
        fi
    else
        n=$(wc -l <"$log")
        if out=$($W restore --workload "k$point" --json 2>&1) && v=$(verify_after "$log" "$n" 60) &&
            [ "$(checksum_of "$v")" = "$sum" ]; then
            echo "PASS: kill $point: the job was gone and restored (at the kill: $before; CUDA state after: $after)"
        else
            echo "FAIL: kill $point: gone and not restored: $out / ${v:-no verify}"
            grep -iE 'giving back|held|GPU|warn|error' "$d/stasisd.log" | tail -8
        fi
    fi
    local left
    left=$(pgrep -f 'swrk|stasis-lazy-guard' | tr '\n' ' ')
    [ -n "$left" ] && echo "note: kill $point: left running: $left"
    kill -9 "$pid" 2>/dev/null
    daemon_stop
    pkill -9 -x stasis-gpu-memt 2>/dev/null
}
sec_kill() { for p in gpu dump upload; do kill_at "$p"; done; }

sec_container() {
    # The pod bundle, from the carried CRIU prefix, stasis-pod and libstasis_enter_root.so
    # (carrying a bundle would double CRIU).
    scripts/pod-bundle.sh "$OUT/pod-bundle" "$CRIU" >/dev/null &&
        cp "$BUNDLE/stasis-pod" "$BUNDLE/libstasis_enter_root.so" "$OUT/pod-bundle/" &&
        POD_BUNDLE=$OUT/pod-bundle bash tests/gpu/container_test.sh
}

# --- the run ---------------------------------------------------------------------------------
# section NAME ESTIMATE_S LIMIT_S
section() {
    local name=$1 est=$2 limit=$3 left start rc
    left=$((BUDGET_S - (SECONDS - T0)))
    if [ "$left" -lt "$est" ]; then
        note "## $name: skipped (${left} s left, needs about ${est} s)"
        return
    fi
    [ "$limit" -gt "$left" ] && limit=$left
    say "section $name (limit $limit s)"
    start=$SECONDS
    timeout -k 5 "$limit" bash "$0" --section "$name" >"$OUT/$name.log" 2>&1
    rc=$?
    note "## $name: exit $rc in $((SECONDS - start)) s"
    note '```'
    case $name in
        env | bandwidth) tail -n 40 "$OUT/$name.log" >>"$REPORT" ;;
        *) grep -E '^(PASS|FAIL|RESULT|note|\||D2H|[0-9]+ passed)' "$OUT/$name.log" >>"$REPORT" || tail -n 25 "$OUT/$name.log" >>"$REPORT" ;;
    esac
    note '```'
    # What a stopped section may have left.
    pkill -9 -x stasis-gpu-memt 2>/dev/null
    pkill -9 -x stasisd 2>/dev/null
}

if [ "${1:-}" = --section ]; then
    have_gpu || [ "$2" = env ] || { echo "no GPU: section $2 not run"; exit 3; }
    "sec_$2"
    exit $?
fi

mkdir -p "$OUT"
: >"$REPORT"
T0=$SECONDS
criu_wrapper
note "# device check $(date -u +%FT%TZ), commit $(git rev-parse --short HEAD 2>/dev/null || echo '?'), budget $BUDGET_S s"
have_gpu || note "(no GPU here: the GPU sections say so and end)"
sections=("$@")
[ ${#sections[@]} -eq 0 ] && sections=(env e2e bandwidth incremental kill lazy container bench idle dataloader)
for s in "${sections[@]}"; do
    case $s in
        env) section env 5 60 ;;
        e2e) section e2e 90 200 ;;
        bandwidth) section bandwidth 50 110 ;;
        incremental) section incremental 35 90 ;;
        kill) section kill 60 130 ;;
        lazy) section lazy 30 80 ;;
        container) section container 30 90 ;;
        idle) section idle 60 120 ;;
        dataloader) section dataloader 40 90 ;;
        bench) section bench 60 150 ;;
        *) note "## $s: unknown section" ;;
    esac
done
note "total $((SECONDS - T0)) s"
cat "$REPORT"
