#!/usr/bin/env bash
# A CUDA job in a container, as stasis handles a Kubernetes container, without a container
# runtime: pid and mount namespaces of its own (unshare), stasis-pod as its init, the pod
# bundle and the pod endpoint mounted where stasis-nri mounts them, stdout and stderr a pipe,
# registered by hand as stasis-nri registers one (`stasis container register`, with its GPU
# device file). The job is evicted through `stasis-pod prestop` (the preStop hook) and
# restored into a second such container; stasisd makes the CUDA phase inside each container
# (the driver as the container sees it, pids as it numbers them).
#
# On a GPU machine (device_check.sh's `container` section), as root, from the repository root:
#
#   STASISD=... STASIS=... CRIU=... POD_BUNDLE=... GPU_MEMTEST=... bash tests/gpu/container_test.sh
#
# the job is the memtest (`--hold`): after the restore it must verify its device memory with
# the checksum it had. Without a GPU, on the fake driver (tests/fake-cuda):
#
#   FAKE_CUDA=target/debug/libstasis_fake_cuda.so STASISD=target/debug/stasisd \
#   STASIS=target/debug/stasis POD_BUNDLE=... bash tests/gpu/container_test.sh
#
# the job is tests/workloads/cuda_counter.py, which must count on from where it stopped, and
# the fake's log of calls must show them made inside each container. POD_BUNDLE: what
# scripts/pod-bundle.sh made, with stasis-pod copied in. CRIU: optional (stasisd's default).
# Prints PASS or FAIL lines; exits non-zero on a failure.
set -u

for var in STASISD STASIS POD_BUNDLE; do
    [ -n "${!var:-}" ] || { echo "container_test.sh: set $var (see the header)" >&2; exit 2; }
done
abspath() { case "$1" in /*) printf '%s\n' "$1" ;; *) printf '%s/%s\n' "$PWD" "$1" ;; esac; }
STASISD=$(abspath "$STASISD")
STASIS=$(abspath "$STASIS")
POD_BUNDLE=$(abspath "$POD_BUNDLE")
FAKE_CUDA=${FAKE_CUDA:+$(abspath "$FAKE_CUDA")}
GPU_MEMTEST=${GPU_MEMTEST:+$(abspath "$GPU_MEMTEST")}
PYTHON=${PYTHON:-$(command -v python3)}
COUNTER=$(abspath tests/workloads/cuda_counter.py)
[ -n "$FAKE_CUDA" ] || [ -n "$GPU_MEMTEST" ] || { echo "container_test.sh: set GPU_MEMTEST or FAKE_CUDA" >&2; exit 2; }

WORK=$(mktemp -d /tmp/stasis-gpu-container.XXXXXX)
SOCK=$WORK/stasisd.sock
DLOG=$WORK/stasisd.log
JOB_LOG=$WORK/job.log
FAKE_STATES=$WORK/lib/states
DAEMON_PID=
UNSHARES=
FAILED=0
MADE_GPU=

say() { printf '%s %s\n' "$(date +%H:%M:%S)" "$*"; }
alive() { [ -d "/proc/$1" ] && ! grep -q '^State:[[:space:]]*Z' "/proc/$1/status" 2>/dev/null; }
fail() {
    FAILED=1
    echo "FAIL: $*"
    echo "--- job log ---"; tail -n 20 "$JOB_LOG" 2>/dev/null
    echo "--- stasisd log (tail) ---"; tail -n 60 "$DLOG" 2>/dev/null
    exit 1
}

cleanup() {
    local pid
    for pid in $UNSHARES; do alive "$pid" && kill -9 "$pid" 2>/dev/null; done
    if [ -n "$DAEMON_PID" ] && alive "$DAEMON_PID"; then kill -TERM "$DAEMON_PID"; sleep 1; kill -9 "$DAEMON_PID" 2>/dev/null; fi
    rmdir /.stasis /.stasis-run 2>/dev/null
    [ -n "$MADE_GPU" ] && rm -f /dev/nvidia0
    if [ "$FAILED" = 0 ]; then rm -rf "$WORK"; else echo "work directory kept: $WORK"; fi
}
trap cleanup EXIT

if [ -n "$FAKE_CUDA" ]; then
    mkdir -p "$WORK/lib" && cp "$FAKE_CUDA" "$WORK/lib/libcuda.so.1"
    export LD_LIBRARY_PATH=$WORK/lib
    # The GPU the fake sees (NVIDIA's major; nothing opens it), while the test runs.
    if [ ! -e /dev/nvidia0 ]; then
        mknod -m 666 /dev/nvidia0 c 195 0 && MADE_GPU=1
    fi
    JOB=("$PYTHON" "$COUNTER" "$WORK/lib/libcuda.so.1")
else
    JOB=("$GPU_MEMTEST" --gib 1 --hold --period-ms 500)
fi

say "starting stasisd (work directory $WORK)"
"$STASISD" --socket "$SOCK" --state-dir "$WORK/state" --store "file://$WORK/store" ${CRIU:+--criu "$CRIU"} \
    --pod-socket "$WORK/run/pod.sock" >"$DLOG" 2>&1 </dev/null &
DAEMON_PID=$!
for _ in $(seq 100); do [ -S "$WORK/run/pod.sock" ] && [ -S "$SOCK" ] && break; sleep 0.1; done
[ -S "$WORK/run/pod.sock" ] || fail "stasisd serves no pod endpoint"
grep -q "GPU checkpointing available" "$DLOG" || fail "stasisd has no CUDA driver"
unset LD_LIBRARY_PATH

# The mount points of the bundle and the endpoint, on the root every container here shares.
mkdir -p /.stasis /.stasis-run

# descendants PID: PID's descendants, each on a line.
descendants() {
    local child
    for child in $(cat /proc/"$1"/task/*/children 2>/dev/null); do echo "$child"; descendants "$child"; done
}

# namespace_init PID: the descendant of PID that is pid 1 of a pid namespace and runs
# stasis-pod (through the bundle's loader), once it does.
namespace_init() {
    local p
    for p in $(descendants "$1"); do
        grep -qE '^NSpid:[[:space:]]+[0-9]+[[:space:]]+1$' "/proc/$p/status" 2>/dev/null &&
            [ "$(readlink "/proc/$p/exe")" = /.stasis/ld.so ] && echo "$p"
    done
}

# container NAME: starts a container whose init runs JOB and registers it; sets C_INIT.
container() {
    local name=$1 unshare_pid
    # The container's shell closes what this shell's caller left open beyond stdio (CRIU
    # cannot dump a descriptor of a mount the container does not see).
    unshare --pid --mount --fork --kill-child --propagation private -- /bin/bash -c "
        mount -t proc proc /proc &&
        for fd in /proc/\$\$/fd/*; do n=\${fd##*/}; if [ \$n -gt 2 ]; then eval \"exec \$n>&-\"; fi; done;
        mount --bind '$POD_BUNDLE' /.stasis && mount --bind '$WORK/run' /.stasis-run &&
        exec /.stasis/ld.so --library-path /.stasis/lib /.stasis/stasis-pod run -- \"\$@\" </dev/null" \
        bash "${JOB[@]}" > >(cat >>"$JOB_LOG") 2>&1 &
    unshare_pid=$!
    disown "$unshare_pid"
    UNSHARES="$UNSHARES $unshare_pid"
    for _ in $(seq 100); do
        C_INIT=$(namespace_init "$unshare_pid")
        [ -n "$C_INIT" ] && break
        sleep 0.1
    done
    [ -n "$C_INIT" ] || fail "$name: no init"
    "$STASIS" --socket "$SOCK" container register --id "$name" --init-pid "$C_INIT" --image job-image \
        --namespace gpu --owner-kind Job --owner-name cudajob --container main --gpu-device /dev/nvidia0 \
        >/dev/null || fail "$name: cannot register"
    say "$name: init $C_INIT"
}

# job_line SKIP REGEX SECONDS: waits for a line of the job's log after its first SKIP lines
# matching REGEX, and prints it.
job_line() {
    local deadline=$((SECONDS + $3)) line
    while [ "$SECONDS" -lt "$deadline" ]; do
        line=$(tail -n +"$(($1 + 1))" "$JOB_LOG" 2>/dev/null | grep -m1 -E "$2")
        [ -n "$line" ] && { printf '%s\n' "$line"; return 0; }
        sleep 0.2
    done
    return 1
}

# The checksum a memtest line (ready, verify) names.
checksum_of() { printf '%s\n' "$1" | sed -n 's/.*checksum=\([0-9a-f]*\).*/\1/p'; }

container first
first_init=$C_INIT
if [ -n "$FAKE_CUDA" ]; then
    job_line 0 '^10$' 60 >/dev/null || fail "the job does not count"
else
    ready=$(job_line 0 '^ready' 180) || fail "no \`ready\` from the memtest"
    job_line 0 '^verify ok' 60 >/dev/null || fail "no \`verify ok\` before the eviction"
    sum=$(checksum_of "$ready")
fi
# The inode of namespace $2 of process $1.
ns_of() { readlink "/proc/$1/ns/$2" | tr -dc 0-9; }
first_ns=$(ns_of "$first_init" pid)
nsenter --target "$first_init" --all -- /.stasis/ld.so --library-path /.stasis/lib /.stasis/stasis-pod prestop \
    >"$WORK/prestop.log" 2>&1 || { cat "$WORK/prestop.log"; fail "the preStop eviction failed"; }
say "evicted: $(cat "$WORK/prestop.log")"
kill -TERM "$first_init"
sleep 0.5
lines=$(wc -l <"$JOB_LOG")
last=$(grep -E '^[0-9]+$' "$JOB_LOG" | tail -n 1)

container second
second_init=$C_INIT
if [ -n "$FAKE_CUDA" ]; then
    next=$(job_line "$lines" '^[0-9]+$' 60) || fail "the restored job does not count"
    [ "$next" = "$((last + 1))" ] || fail "the restored job counts $next after $last"
    say "the job counts on: $last, then $next"
    # Where each call was made: field 3 of the fake's log is the caller's pid namespace.
    made_in() { awk -v call="$1" '$1 == call { print $3 }' "$FAKE_STATES/calls"; }
    second_ns=$(ns_of "$second_init" pid)
    for call in lock checkpoint; do
        [ "$(made_in $call)" = "pidns=$first_ns" ] ||
            fail "$call was not made in the first container: $(cat "$FAKE_STATES/calls")"
    done
    for call in restore unlock; do
        [ "$(made_in $call)" = "pidns=$second_ns" ] ||
            fail "$call was not made in the second container: $(cat "$FAKE_STATES/calls")"
    done
else
    v=$(job_line "$lines" '^verify' 120) || fail "the restored memtest does not verify"
    [ "$(checksum_of "$v")" = "$sum" ] ||
        fail "the restored memtest's checksum changed: $v (was $sum)"
    say "the restored memtest verifies: $v"
fi
echo "PASS: a CUDA job evicted from a container and restored into another, its CUDA phase inside each"
