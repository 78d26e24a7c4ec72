#!/usr/bin/env bash
# GPU end-to-end tests of stasis: checkpoint and restore CUDA processes through a real stasisd
# and a real CRIU, and check that GPU memory and a training run come back intact.
#
# Run ON a GPU machine, as root, from the repository root:
#
#   STASISD=target/debug/stasisd STASIS=target/debug/stasis CRIU=/usr/local/sbin/criu \
#   GPU_MEMTEST=target/debug/stasis-gpu-memtest bash tests/gpu/run_gpu_tests.sh
#
# Optional: PYTHON (default: python3 on PATH; needs PyTorch with CUDA), TRAIN_PY (default
# tests/gpu/train.py), GPU_PROBE (stasis-gpu-probe: prints GPUs and CUDA process states on
# failure), MEMTEST_GIB (default 1), KEEP_WORK=1 (keep the temporary directory), LAZY=1
# (every restore is a lazy one: `stasis restore --lazy`), TESTS (default: all three; a subset of
# `memtest-evict memtest-leave-running train`).
#
# Tests:
#   1. memtest --hold, checkpoint (evicts), restore: `verify ok` with the checksum of `ready`;
#   2. the same with --leave-running: the original goes on, is killed, the checkpoint restores;
#   3. train.py: the losses of steps 1..60 of a run evicted around step 20 and restored equal
#      those of an uninterrupted run.
# (Two more scripts, run the same way: dataloader_test.sh, DataLoader worker trees; and
# idle_test.sh, idle reclaim of a job whose GPU works while its CPU sleeps.)
# Prints PASS/FAIL lines and finally `N passed, M failed`; exits non-zero on any failure.

set -u

for var in STASISD STASIS CRIU GPU_MEMTEST; do
    if [ -z "${!var:-}" ]; then
        echo "run_gpu_tests.sh: set $var (see the header of this script)" >&2
        exit 2
    fi
done
abspath() { case "$1" in /*) printf '%s\n' "$1" ;; *) printf '%s/%s\n' "$PWD" "$1" ;; esac; }
STASISD=$(abspath "$STASISD")
STASIS=$(abspath "$STASIS")
GPU_MEMTEST=$(abspath "$GPU_MEMTEST")
PYTHON=${PYTHON:-$(command -v python3 || echo python3)}
TRAIN_PY=$(abspath "${TRAIN_PY:-tests/gpu/train.py}")
GPU_PROBE=${GPU_PROBE:-}
MEMTEST_GIB=${MEMTEST_GIB:-1}
CLI_TIMEOUT=${CLI_TIMEOUT:-600}
RESTORE_FLAGS=()
if [ "${LAZY:-0}" = 1 ]; then
    RESTORE_FLAGS=(--lazy)
fi

PASSED=0
FAILED=0
WORK=$(mktemp -d /tmp/stasis-gpu.XXXXXX)
SOCK=$WORK/stasisd.sock
DLOG=$WORK/stasisd.log
DAEMON_PID=
WORKLOAD_PIDS=

say() { printf '%s %s\n' "$(date +%H:%M:%S)" "$*"; }
pass() { PASSED=$((PASSED + 1)); echo "PASS: $*"; }
fail() { FAILED=$((FAILED + 1)); echo "FAIL: $*"; diagnostics; }

diagnostics() {
    echo "--- stasisd log (tail) ---"
    tail -n 150 "$DLOG" 2>/dev/null
    echo "--- end of stasisd log ---"
    if [ -n "$GPU_PROBE" ] && [ -n "$WORKLOAD_PIDS" ]; then
        # shellcheck disable=SC2086 # a list of pids
        # The workloads' inits and their children (the CUDA processes).
        # shellcheck disable=SC2086,SC2046 # lists of pids
        "$GPU_PROBE" state $WORKLOAD_PIDS $(cat $(printf '/proc/%s/task/*/children ' $WORKLOAD_PIDS) 2>/dev/null) 2>&1 |
            sed 's/^/probe: /'
    fi
    nvidia-smi --query-compute-apps=pid,used_memory --format=csv 2>/dev/null | sed 's/^/nvidia-smi: /'
}

alive() { [ -d "/proc/$1" ] && ! grep -q '^State:[[:space:]]*Z' "/proc/$1/status" 2>/dev/null; }

kill_tree() {
    local pid=$1 child
    # shellcheck disable=SC2013 # the children files hold space-separated pids
    for child in $(cat /proc/"$pid"/task/*/children 2>/dev/null); do kill_tree "$child"; done
    kill -9 "$pid" 2>/dev/null
}

# wait_gone PID SECONDS
wait_gone() {
    local deadline=$((SECONDS + $2))
    while alive "$1"; do
        [ "$SECONDS" -ge "$deadline" ] && return 1
        sleep 0.2
    done
}

cleanup() {
    local pid
    for pid in $WORKLOAD_PIDS; do alive "$pid" && kill_tree "$pid"; done
    if [ -n "$DAEMON_PID" ] && alive "$DAEMON_PID"; then
        kill -TERM "$DAEMON_PID" 2>/dev/null
        wait_gone "$DAEMON_PID" 15 || kill -9 "$DAEMON_PID" 2>/dev/null
    fi
    if [ "${KEEP_WORK:-0}" = 1 ] || [ "$FAILED" -gt 0 ]; then
        echo "work directory kept: $WORK"
    else
        rm -rf "$WORK"
    fi
}
trap cleanup EXIT
trap 'exit 130' INT TERM

stasis() { timeout "$CLI_TIMEOUT" "$STASIS" --socket "$SOCK" "$@"; }

# json_get FIELD < JSON: prints a field (nested with dots: stats.bytes_total); fails when absent.
json_get() {
    python3 -c '
import json, sys
v = json.load(sys.stdin)
for k in sys.argv[1].split("."):
    v = v[k]
print(str(v).lower() if isinstance(v, bool) else v)' "$1"
}

# lines_after FILE SKIP: the complete lines of FILE after its first SKIP, without CRs.
lines_after() { tail -n +"$(($2 + 1))" "$1" 2>/dev/null | tr -d '\r'; }
line_count() { tr -d '\r' <"$1" 2>/dev/null | wc -l; }

# wait_line FILE SKIP REGEX SECONDS [PID]: prints the first line after SKIP matching REGEX;
# fails on timeout, or early when PID is given and exits.
wait_line() {
    local file=$1 skip=$2 re=$3 deadline=$((SECONDS + $4)) pid=${5:-} line
    while :; do
        line=$(lines_after "$file" "$skip" | grep -m1 -E "$re")
        if [ -n "$line" ]; then
            printf '%s\n' "$line"
            return 0
        fi
        if [ -n "$pid" ] && ! alive "$pid"; then
            echo "process $pid exited while waiting for /$re/ in $file" >&2
            return 1
        fi
        if [ "$SECONDS" -ge "$deadline" ]; then
            echo "timed out after $4 s waiting for /$re/ in $file" >&2
            return 1
        fi
        sleep 0.2
    done
}

show_log() {
    echo "--- $1 (tail) ---"
    tail -n "${2:-40}" "$1" 2>/dev/null | tr -d '\r'
    echo "--- end ---"
}

# run_workload NAME ARGV...: starts a workload; sets W_PID and W_LOG.
run_workload() {
    local name=$1 out
    shift
    if ! out=$(stasis run --workload "$name" --json -- "$@"); then
        echo "stasis run --workload $name failed: $out" >&2
        return 1
    fi
    if ! W_PID=$(printf '%s' "$out" | json_get pid) || ! W_LOG=$(printf '%s' "$out" | json_get log); then
        echo "stasis run --workload $name printed no pid and log: $out" >&2
        return 1
    fi
    WORKLOAD_PIDS="$WORKLOAD_PIDS $W_PID"
    say "started $name: pid $W_PID, log $W_LOG"
}

# restored_pid JSON: W_PID becomes the pid of a restore's answer.
restored_pid() {
    W_PID=$(printf '%s' "$1" | json_get pid) || return 1
    WORKLOAD_PIDS="$WORKLOAD_PIDS $W_PID"
}

# checksum_of LINE: the value of checksum= in LINE.
checksum_of() { printf '%s\n' "$1" | sed -n 's/.*checksum=\([0-9a-f]*\).*/\1/p'; }

start_daemon() {
    say "starting stasisd (work directory $WORK)"
    "$STASISD" --socket "$SOCK" --state-dir "$WORK/state" --store "file://$WORK/store" --criu "$CRIU" \
        >"$DLOG" 2>&1 </dev/null &
    DAEMON_PID=$!
    local deadline=$((SECONDS + 30))
    until [ -S "$SOCK" ]; do
        if ! alive "$DAEMON_PID" || [ "$SECONDS" -ge "$deadline" ]; then
            echo "stasisd did not start"
            show_log "$DLOG" 100
            exit 1
        fi
        sleep 0.1
    done
}

# The memtest: ready -> checkpoint -> restore -> `verify ok` with the same checksum.
# $1: test name, $2: workload name, $3: "evict" or "leave-running".
test_memtest() {
    local t=$1 name=$2 mode=$3 ready sum ck id left n r rpid v
    run_workload "$name" "$GPU_MEMTEST" --gib "$MEMTEST_GIB" --hold --period-ms 500 || {
        fail "$t: cannot start the memtest"
        return
    }
    if ! ready=$(wait_line "$W_LOG" 0 '^(ready|verify FAILED)' 180 "$W_PID") || [ "${ready#ready}" = "$ready" ]; then
        show_log "$W_LOG"
        fail "$t: no \`ready\` from the memtest"
        return
    fi
    sum=$(checksum_of "$ready")
    say "$t: $ready"
    if ! wait_line "$W_LOG" 0 '^verify ok' 60 "$W_PID" >/dev/null; then
        show_log "$W_LOG"
        fail "$t: no \`verify ok\` before the checkpoint"
        return
    fi

    if [ "$mode" = leave-running ]; then
        ck=$(stasis checkpoint --workload "$name" --leave-running --json)
    else
        ck=$(stasis checkpoint --workload "$name" --json)
    fi
    # shellcheck disable=SC2181 # the status of the command substitution above
    if [ $? -ne 0 ]; then
        show_log "$W_LOG"
        fail "$t: stasis checkpoint failed: $ck"
        return
    fi
    say "$t: checkpoint: $ck"
    id=$(printf '%s' "$ck" | json_get id)
    left=$(printf '%s' "$ck" | json_get left_running)

    if [ "$mode" = leave-running ]; then
        if [ "$left" != true ]; then
            fail "$t: left_running is $left after --leave-running"
            return
        fi
        n=$(line_count "$W_LOG")
        if ! v=$(wait_line "$W_LOG" "$n" '^verify' 60 "$W_PID") || [ "$(checksum_of "$v")" != "$sum" ]; then
            show_log "$W_LOG"
            fail "$t: the original did not go on verifying after the checkpoint (${v:-nothing})"
            return
        fi
        say "$t: the original goes on: $v"
        kill_tree "$W_PID"
    elif [ "$left" != false ]; then
        fail "$t: left_running is $left without --leave-running"
        return
    fi
    if ! wait_gone "$W_PID" 60; then
        fail "$t: pid $W_PID still runs after the checkpoint"
        return
    fi

    n=$(line_count "$W_LOG")
    if [ "$mode" = leave-running ]; then
        r=$(stasis restore "$id" "${RESTORE_FLAGS[@]}" --json)
    else
        r=$(stasis restore --workload "$name" "${RESTORE_FLAGS[@]}" --json)
    fi
    # shellcheck disable=SC2181 # the status of the command substitution above
    if [ $? -ne 0 ]; then
        show_log "$W_LOG"
        fail "$t: stasis restore failed: $r"
        return
    fi
    say "$t: restore: $r"
    # A workload lives in a pid namespace of its own: its restored init has a new outside pid.
    restored_pid "$r" || {
        fail "$t: the restore printed no pid: $r"
        return
    }
    if ! v=$(wait_line "$W_LOG" "$n" '^verify ' 120 "$W_PID"); then
        show_log "$W_LOG"
        fail "$t: no \`verify\` line after the restore"
        return
    fi
    say "$t: after the restore: $v"
    case "$v" in
        "verify ok "*) ;;
        *)
            show_log "$W_LOG"
            fail "$t: GPU memory differs after the restore: $v"
            return
            ;;
    esac
    if [ "$(checksum_of "$v")" != "$sum" ]; then
        show_log "$W_LOG"
        fail "$t: checksum $(checksum_of "$v") after the restore, $sum at \`ready\`"
        return
    fi
    # A second verification: the restored process keeps running on the GPU.
    n=$(line_count "$W_LOG")
    if ! v=$(wait_line "$W_LOG" "$n" '^verify ' 30 "$W_PID") || [ "$(checksum_of "$v")" != "$sum" ]; then
        show_log "$W_LOG"
        fail "$t: the restored memtest did not go on (${v:-nothing})"
        return
    fi
    pass "$t: GPU memory identical after checkpoint and restore (checksum $sum)"
    kill_tree "$W_PID"
    wait_gone "$W_PID" 30
}

# losses FILE MAX: `N VALUE` for each `step N loss=VALUE` line with N <= MAX, in order.
losses() {
    tr -d '\r' <"$1" | awk -v max="$2" '
        /^step [0-9]+ loss=/ { n = $2 + 0; sub(/^loss=/, "", $3); if (n <= max) print n, $3 }'
}

test_train() {
    local t=train steps=60 at=20 ref="$WORK/train-reference.txt" got="$WORK/train-restored.txt" ck r
    if ! "$PYTHON" -c 'import torch; assert torch.cuda.is_available()' 2>/dev/null; then
        fail "$t: $PYTHON has no PyTorch with CUDA"
        return
    fi
    # 1. The reference: an uninterrupted run.
    run_workload train-ref "$PYTHON" -u "$TRAIN_PY" --steps "$steps" --sleep 0.05 || {
        fail "$t: cannot start the reference run"
        return
    }
    if ! wait_line "$W_LOG" 0 "^(train done|Traceback)" 600 "$W_PID" | grep -q '^train done'; then
        show_log "$W_LOG"
        fail "$t: the reference run did not finish"
        return
    fi
    losses "$W_LOG" "$steps" >"$ref"
    if [ "$(wc -l <"$ref")" -ne "$steps" ]; then
        show_log "$W_LOG"
        fail "$t: the reference run printed $(wc -l <"$ref") losses, expected $steps"
        return
    fi
    wait_gone "$W_PID" 30

    # 2. The same run, evicted around step $at and restored.
    run_workload train-ckpt "$PYTHON" -u "$TRAIN_PY" --steps "$steps" --sleep 0.25 || {
        fail "$t: cannot start the checkpointed run"
        return
    }
    if ! wait_line "$W_LOG" 0 "^step $at " 600 "$W_PID" >/dev/null; then
        show_log "$W_LOG"
        fail "$t: the checkpointed run did not reach step $at"
        return
    fi
    if ! ck=$(stasis checkpoint --workload train-ckpt --json); then
        show_log "$W_LOG"
        fail "$t: stasis checkpoint failed: $ck"
        return
    fi
    say "$t: checkpoint: $ck"
    if ! wait_gone "$W_PID" 60; then
        fail "$t: pid $W_PID still runs after the checkpoint"
        return
    fi
    say "$t: evicted after $(losses "$W_LOG" 100000 | tail -n 1 | cut -d' ' -f1) steps"
    if ! r=$(stasis restore --workload train-ckpt "${RESTORE_FLAGS[@]}" --json); then
        show_log "$W_LOG"
        fail "$t: stasis restore failed: $r"
        return
    fi
    say "$t: restore: $r"
    restored_pid "$r" || {
        fail "$t: the restore printed no pid: $r"
        return
    }
    if ! wait_line "$W_LOG" 0 "^(train done|Traceback)" 600 "$W_PID" | grep -q '^train done'; then
        show_log "$W_LOG"
        fail "$t: the restored run did not finish"
        return
    fi
    losses "$W_LOG" "$steps" >"$got"

    # Every step 1..60 printed, each with the reference's loss (a step printed twice across
    # the checkpoint must print the same value both times).
    local verdict
    verdict=$(awk -v steps="$steps" '
        FNR == NR { want[$1] = $2; next }
        {
            seen[$1] = 1
            if (($2 "") != (want[$1] "")) { printf "step %s: loss %s, reference %s\n", $1, $2, want[$1]; bad = 1; exit }
        }
        END {
            if (bad) exit 1
            for (i = 1; i <= steps; i++) if (!(i in seen)) { printf "step %d missing\n", i; exit 1 }
        }' "$ref" "$got")
    # shellcheck disable=SC2181 # the status of the command substitution above
    if [ $? -ne 0 ]; then
        show_log "$W_LOG" 80
        fail "$t: losses differ from the uninterrupted run: $verdict"
        return
    fi
    pass "$t: losses of steps 1..$steps identical across checkpoint (at step ~$at) and restore"
}

say "GPU: $(nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv,noheader 2>/dev/null || echo 'nvidia-smi not found')"
[ -n "$GPU_PROBE" ] && "$GPU_PROBE" gpus 2>&1 | sed 's/^/probe: /'
start_daemon
for t in ${TESTS:-memtest-evict memtest-leave-running train}; do
    case $t in
        memtest-evict) test_memtest memtest-evict gpumem evict ;;
        memtest-leave-running) test_memtest memtest-leave-running gpumem-lr leave-running ;;
        train) test_train ;;
        *) fail "unknown test $t (TESTS)" ;;
    esac
done

echo "$PASSED passed, $FAILED failed"
[ "$FAILED" -eq 0 ]
