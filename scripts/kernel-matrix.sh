#!/usr/bin/env bash
# The kernel matrix: runs an end-to-end subset of stasis on Debian's kernels, each booted in a
# qemu virtual machine, and prints a table (kernel, test, result).
#
# Usage: scripts/kernel-matrix.sh [SERIES...]     SERIES: 5.10 (bullseye), 6.1 (bookworm),
#                                                 6.12 (trixie); default: all three
#        scripts/kernel-matrix.sh --fetch [SERIES...]   only fetch the kernels
# Environment: KM_CASES (the cases to run, space-separated; default all: counter tcp lazy
# incremental idle shm tracked rseq; track-cost and evict-cost run only when named), KM_MEM (guest MiB, 1536),
# KM_PROFILE (the cargo profile whose binaries run: debug, or release for measurements),
# KM_THP (the guest's transparent-huge-page mode, given on its command line: always, madvise
# or never; default the kernel's own, "always" in Debian's),
# KM_PERF (an evict-cost round to profile: evict-blocks, evict-tracked, evict-blocks-untracked
# or evict-untracked; `perf record -a` in the guest over its eviction, the busiest commands
# and symbols printed to the console log as PERFCOMM and PERFSYM lines; needs the host's perf),
# KM_SMP (guest CPUs, 2), KM_TIMEOUT (seconds per kernel, 1800), KM_REFRESH=1 (fetch the
# kernels again), KM_RESULTS (the table's file, default .stasis/kernel-matrix/results.txt).
#
# What it installs: qemu-system-x86 from Debian with apt-get when qemu-system-x86_64 is missing
# (the only system package); for each series the newest generic `amd64-unsigned` kernel image
# package of its Debian suite, fetched with apt-get download (a private sources list and lists
# directory) and unpacked with dpkg -x under .stasis/kernel-matrix/kernels/SERIES (nothing goes
# into the host's /boot or /lib/modules); busybox-static from bookworm the same way when
# /bin/busybox is not a static binary. It needs a built tree (`cargo build --workspace`: it
# runs target/debug/stasisd, stasis, stasis-init, stasis-lazy-guard) and CRIU
# (scripts/setup-criu.sh, run here when .stasis/criu is missing).
#
# How: the guest boots under TCG (`-accel tcg`: KVM guests hang on the VMs this was written
# on) with an initramfs made here: a static busybox, the modules the kernel package has for
# virtio, 9p, nf_tables and sock_diag (CRIU needs the last two), and an /init that loads them,
# mounts this machine's root file system read-only over virtio 9p and switch_roots into it,
# running this script again (`--guest`) as the guest's pid 1. That mounts /proc, /sys, /dev,
# cgroup2, tmpfs on /run, /tmp and /dev/shm, brings up loopback, starts stasisd with its state
# and file store on the tmpfs, and runs each case (`--case NAME`, driving the stasis CLI and the
# Python workloads of tests/workloads), then powers off. The guest writes results on its
# serial console as `KMRESULT case result`; this side reads them from the console log (kept in
# .stasis/kernel-matrix/console-SERIES.log, with each case's log and stasisd's on failure).
#
# The cases, each checking what the workload does afterwards:
#   counter      a counter evicted and restored counts on: every number once, in order
#   tcp          a server with an established connection to a peer outside its tree, evicted
#                and restored: the peer's one connection carries on (every echo, in order) and
#                the listener answers
#   lazy         a process holding 8 MiB, evicted and restored lazily: it ticks on, its
#                memory's checksum unchanged
#   incremental  a checkpoint left running, then an eviction that uploads little of the same
#                memory; the restore ticks on with the same checksum; `stasis check --read-data`
#   idle         an idle HTTP server reclaimed, then woken by a plain request that it answers
#                with its next hit count and the same memory checksum
#   shm          a parent and forked child sharing memory, evicted and restored: same
#                checksums, and a write by one is still seen by the other
#   rseq         a Python process started outside stasis (setsid, no GLIBC_TUNABLES), so its
#                glibc registered rseq: before 5.13 `stasis checkpoint PID` refuses it up front
#                (non-zero exit, naming rseq) and it ticks on, never frozen; from 5.13 on it is
#                evicted, restored by checkpoint id, and ticks on
#   tracked      dirty-page tracking: a process whose memory changes between five checkpoints
#                (pages rewritten, a child forked, a mapping mremapped, one unmapped), with
#                stasisd restarted between two of them; each checkpoint takes unchanged memory
#                from the one before where `stasis status` says tracking is on (none after the
#                first or the restart, and none at all where it is off); left running, evicted
#                and restored it keeps its checksum; the second checkpoint, whose parent is
#                deleted and collected, restores alone with its own; `stasis check --read-data`
#   track-cost   (on demand, not in the default list: a measurement) a process of up to 512 MiB
#                (a fifth of the guest's free memory: KM_MEM=4096 for 512), half random, half
#                compressible, checkpointed left running, then 10% rewritten and evicted, once
#                with tracking and once with stasisd restarted with --memory-tracking off; the
#                table's result gives the evictions' frozen, dump and durable times, tracked /
#                untracked (a case's `SUMMARY:` line follows its pass)
#   evict-cost   (on demand: a measurement) the Kubernetes eviction's shape without containerd:
#                stasis-bench-workload (up to 1 GiB, KM_MEM=6144 for that; half random, half
#                compressible, heap churn) checkpointed left running (cold), 10% rewritten and
#                evicted, then restored lazily with its checksum; the same without the churn
#                (10% in 1 MiB blocks only); each tracked and untracked; the result gives each
#                eviction's durable time against its cold checkpoint and tracked / untracked
set -euo pipefail

self=$(realpath "$0")
# The guest runs a copy of this script and of the binaries, made at the start of the run (see
# snapshot), so that a rebuild or an edit in the checkout meanwhile does not reach it.
root=${KM_ROOT:-$(cd "$(dirname "$self")/.." && pwd)}
bin=${KM_BIN:-$root/target/debug}
all_cases="counter tcp lazy incremental idle shm tracked rseq"

# ---------------------------------------------------------------------------------------------
# Inside the guest: one case (run by the guest's pid 1 as a separate process, so that `set -e`
# and `fail` end the case, not the machine).
# ---------------------------------------------------------------------------------------------

fail() {
  echo "REASON: $*" >&2
  exit 1
}

st() { "$bin/stasis" --socket "$KM_STATE/stasisd.sock" "$@"; }

# Runs the CLI; prints its stdout; on failure ends the case with its error (its first line,
# and CRIU's first error where it quotes CRIU's log).
cli() {
  local out err=$KM_STATE/cli.err
  if ! out=$(st "$@" 2>"$err"); then
    local first criu_error
    first=$(head -n 1 "$err")
    criu_error=$(grep -m 1 -o 'Error (criu.*' "$err" || true)
    case $first in *"$criu_error"*) criu_error= ;; esac
    fail "stasis $1: $(cut -c 1-300 <<<"$first")${criu_error:+ [CRIU: $criu_error]}"
  fi
  printf '%s\n' "$out"
}

# json FIELD.PATH: a field of the JSON object on stdin (dots separate keys).
json() {
  python3 -c '
import json, sys
v = json.load(sys.stdin)
for k in sys.argv[1].split("."):
    v = v[k]
print(json.dumps(v) if isinstance(v, (dict, list, bool)) or v is None else v)' "$1"
}

# workload NAME FIELD: a field of workload NAME in `stasis status --json`.
workload() {
  cli status --json | python3 -c '
import json, sys
for w in json.load(sys.stdin)["workloads"]:
    if w["name"] == sys.argv[1]:
        print(w.get(sys.argv[2], ""))' "$1" "$2"
}

# wait_for SECONDS WHAT COMMAND...: polls COMMAND until it succeeds (COMMAND's arguments are
# expanded once, by the caller: what must be read afresh is read by COMMAND).
wait_for() {
  local secs=$1 what=$2
  shift 2
  local deadline=$((SECONDS + secs))
  until "$@" >/dev/null 2>&1; do
    [ $SECONDS -lt $deadline ] || fail "no $what within ${secs}s"
    sleep 0.5
  done
}

# numbers LOG PREFIX: the numbers of the lines `PREFIX<n>...` of LOG, one a line.
numbers() { sed -n "s/^$2\([0-9][0-9]*\).*/\1/p" "$1"; }
last_number() { numbers "$1" "$2" | tail -n 1; }
reached() { [ "$(last_number "$1" "$2")" -ge "$3" ] 2>/dev/null; }

# consecutive LOG PREFIX: every number of LOG's PREFIX lines is the one before plus one.
consecutive() {
  numbers "$1" "$2" | awk -v what="$2" '
    NR > 1 && $1 != prev + 1 { print "after " what prev " comes " what $1; bad = 1; exit }
    { prev = $1 } END { exit bad }'
}

gone() { ! kill -0 "$1" 2>/dev/null; }
in_state() { [ "$(workload "$1" state)" = "$2" ]; }
lines_at_least() { [ "$(grep -c "$2" "$1")" -ge "$3" ]; }

free_port() {
  python3 -c 'import socket; s = socket.socket(); s.bind(("127.0.0.1", 0)); print(s.getsockname()[1])'
}

http_get() {
  python3 -c '
import sys, urllib.request
print(urllib.request.urlopen(f"http://127.0.0.1:{sys.argv[1]}/", timeout=float(sys.argv[2])).read().decode().strip())' "$1" "${2:-30}"
}

# start NAME [run options] -- COMMAND...: starts a workload; sets pid and log.
start() {
  local name=$1
  shift
  local out
  out=$(cli run --workload "$name" --json "$@")
  pid=$(json pid <<<"$out")
  log=$(workload "$name" log_path)
  [ -n "$log" ] || fail "no log path for $name"
}

# evict NAME: checkpoints NAME (an eviction); sets ck (its JSON); waits for the tree to go.
evict() {
  ck=$(cli checkpoint --workload "$1" --json)
  [ "$(json left_running <<<"$ck")" = false ] || fail "eviction left the tree running: $ck"
  wait_for 60 "end of the evicted tree (pid $pid)" gone "$pid"
}

# restore NAME [options]: restores NAME's latest checkpoint; sets r (its JSON) and pid.
restore() {
  local name=$1
  shift
  r=$(cli restore --workload "$name" --json "$@")
  pid=$(json pid <<<"$r")
  kill -0 "$pid" 2>/dev/null || fail "restored pid $pid is not running"
}

py=/usr/bin/python3
workloads=$root/tests/workloads

case_counter() {
  start counter -- "$py" -u "$workloads/counter.py"
  wait_for 120 "10 counts" reached "$log" "count " 10
  evict counter
  local last
  last=$(last_number "$log" "count ")
  sleep 1
  [ "$(last_number "$log" "count ")" = "$last" ] || fail "the evicted counter went on counting"
  restore counter
  wait_for 120 "counts past $last after the restore" reached "$log" "count " $((last + 10))
  consecutive "$log" "count " || fail "counts not consecutive: $(consecutive "$log" "count ")"
  echo "counted to $last, evicted, restored, counted on to $(last_number "$log" "count ")"
}

case_tcp() {
  local network_lock
  network_lock=$(cli status --json | json network_lock)
  echo "network lock: $network_lock"
  # The peer: an echo server outside the tree, counting the connections it accepts.
  local peer_log=$KM_STATE/peer.log
  "$py" -u -c '
import socket
s = socket.create_server(("127.0.0.1", 0))
print("port", s.getsockname()[1], flush=True)
n = 0
while True:
    c, _ = s.accept()
    n += 1
    print("accepted", n, flush=True)
    f = c.makefile("rwb")
    for line in f:
        f.write(line)
        f.flush()
    print("closed", flush=True)
' >"$peer_log" 2>&1 &
  wait_for 60 "peer to listen" grep -q '^port ' "$peer_log"
  local peer_port http_port
  peer_port=$(sed -n 's/^port //p' "$peer_log")
  http_port=$(free_port)
  start tcp -- "$py" -u "$workloads/net.py" --peer "$peer_port" --http "$http_port" --hold-mib 1
  wait_for 120 "10 echoes from the peer" reached "$log" "echo " 10
  local before
  before=$(http_get "$http_port" | sed -n 's/^tick //p')
  [ -n "$before" ] || fail "the listener did not answer before the checkpoint"
  evict tcp
  local last
  last=$(last_number "$log" "echo ")
  restore tcp
  wait_for 120 "echoes past $last after the restore" reached "$log" "echo " $((last + 10))
  ! grep -q '^peer lost' "$log" || fail "$(grep '^peer lost' "$log" | head -n 1)"
  consecutive "$log" "echo " || fail "echoes not consecutive: $(consecutive "$log" "echo ")"
  [ "$(grep -c '^accepted' "$peer_log")" = 1 ] || fail "the peer saw $(grep -c '^accepted' "$peer_log") connections"
  ! grep -q '^closed' "$peer_log" || fail "the peer's connection was closed"
  local after
  after=$(http_get "$http_port" | sed -n 's/^tick //p')
  [ "${after:-0}" -gt "$before" ] || fail "the restored listener answered tick '$after' (before: $before)"
  echo "echo $last before the eviction, $(last_number "$log" "echo ") after; one connection; listener tick $before -> $after"
}

# sums LOG: the distinct checksums of LOG's `tick N ok SUM` lines.
sums() { sed -n 's/^tick [0-9]* ok //p' "$1" | sort -u; }

case_lazy() {
  start lazy -- "$py" -u "$workloads/net.py" --hold-mib 8
  wait_for 120 "5 ticks" reached "$log" "tick " 5
  evict lazy
  local last
  last=$(last_number "$log" "tick ")
  restore lazy --lazy
  [ "$(json stats.lazy <<<"$r")" = true ] || fail "the restore was not lazy: $r"
  wait_for 120 "ticks past $last after the lazy restore" reached "$log" "tick " $((last + 5))
  consecutive "$log" "tick " || fail "ticks not consecutive: $(consecutive "$log" "tick ")"
  [ "$(sums "$log" | wc -l)" = 1 ] || fail "the memory's checksum changed: $(sums "$log" | tr '\n' ' ')"
  echo "tick $last before, $(last_number "$log" "tick ") after a lazy restore; checksum $(sums "$log")"
}

case_incremental() {
  start incr -- "$py" -u "$workloads/net.py" --hold-mib 8
  wait_for 120 "5 ticks" reached "$log" "tick " 5
  local ck1
  ck1=$(cli checkpoint --workload incr --leave-running --json)
  wait_for 60 "ticks after the first checkpoint" reached "$log" "tick " $(($(last_number "$log" "tick ") + 3))
  evict incr
  local total new
  total=$(json stats.chunks_total <<<"$ck")
  new=$(json stats.chunks_new <<<"$ck")
  echo "first: $(json stats.chunks_new <<<"$ck1") of $(json stats.chunks_total <<<"$ck1") chunks new; second: $new of $total"
  [ "$total" -ge 128 ] || fail "the second checkpoint holds only $total chunks (8 MiB are 128)"
  [ $((new * 4)) -lt "$total" ] || fail "the second checkpoint uploaded $new of $total chunks"
  local last
  last=$(last_number "$log" "tick ")
  restore incr
  wait_for 120 "ticks past $last after the restore" reached "$log" "tick " $((last + 5))
  consecutive "$log" "tick " || fail "ticks not consecutive: $(consecutive "$log" "tick ")"
  [ "$(sums "$log" | wc -l)" = 1 ] || fail "the memory's checksum changed: $(sums "$log" | tr '\n' ' ')"
  cli check --read-data >/dev/null
  echo "second checkpoint: $new of $total chunks new; restored, ticks on to $(last_number "$log" "tick "); store checks clean"
}

case_idle() {
  local port
  port=$(free_port)
  start idle --idle-after 3s -- "$py" -u "$workloads/http_counter.py" "$port" 8
  wait_for 120 "the server to listen" grep -q '^ready' "$log"
  local first
  first=$(http_get "$port" 120)
  echo "before: $first"
  case $first in "hits "[0-9]*" sum "*) ;; *) fail "unexpected answer '$first'" ;; esac
  wait_for 180 "reclaim" in_state idle reclaimed
  wait_for 60 "end of the reclaimed server" gone "$pid"
  local woken
  woken=$(http_get "$port" 240) || fail "the request to the reclaimed server got no answer"
  echo "after: $woken"
  local hits=${first#hits }
  hits=${hits%% *}
  [ "$woken" = "hits $((hits + 1)) sum ${first##* sum }" ] || fail "woken server answered '$woken' after '$first'"
}

# shm_pids: sets parent and child, the pids (here) of shared_memory.py's two processes.
shm_pids() {
  parent=$(cat /proc/"$pid"/task/*/children | tr ' ' '\n' | grep . | head -n 1)
  [ -n "$parent" ] || fail "no process under the workload's init $pid"
  # The workload's pid may be its command itself (no pid namespace of its own).
  if ! grep -q shared_memory /proc/"$parent"/cmdline 2>/dev/null; then
    child=$parent
    parent=$pid
  else
    child=$(cat /proc/"$parent"/task/*/children | tr ' ' '\n' | grep . | head -n 1)
  fi
  [ -n "$child" ] || fail "shared_memory.py has no child"
}

case_shm() {
  start shm -- "$py" -u "$workloads/shared_memory.py" KMMARK
  wait_for 120 "both processes ready" lines_at_least "$log" '^ready' 2
  local parent child
  shm_pids
  kill -USR2 "$parent"
  wait_for 60 "checksums" lines_at_least "$log" '^sums' 2
  local before
  before=$(sed -n 's/^sums [0-9]* //p' "$log" | sort -u)
  [ "$(wc -l <<<"$before")" = 1 ] || fail "parent and child differ before the checkpoint: $before"
  evict shm
  restore shm
  shm_pids
  kill -USR2 "$parent"
  wait_for 60 "checksums after the restore" lines_at_least "$log" '^sums' 4
  local after
  after=$(sed -n 's/^sums [0-9]* //p' "$log" | sort -u)
  [ "$after" = "$before" ] || fail "checksums after the restore: $(tr '\n' ' ' <<<"$after")(before: $before)"
  kill -USR1 "$parent"
  wait_for 60 "the child to see the parent's write" grep -q '^seen' "$log"
  local marked seen zeros
  zeros=$(sed -n 's/^zeros //p' "$log")
  marked=$(sed -n 's/^marked //p' "$log")
  seen=$(sed -n 's/^seen //p' "$log")
  [ "$marked" != "$zeros" ] || fail "the parent's write changed nothing"
  [ "$seen" = "$marked" ] || fail "the child does not see the parent's write: '$seen', parent '$marked'"
  echo "checksum $before kept by parent $parent and child $child; shared mappings still shared"
}

# script_pid SCRIPT: the pid (here) of the workload's process running SCRIPT: the root of its
# tree, or the root's child where the root is the init of the workload's pid namespace.
script_pid() {
  local p
  for p in "$pid" $(cat /proc/"$pid"/task/*/children 2>/dev/null); do
    if grep -q -a -- "$1" "/proc/$p/cmdline" 2>/dev/null; then
      echo "$p"
      return
    fi
  done
  fail "no process runs $1 in the tree of $pid"
}

# thp_mode: the kernel's transparent-huge-page mode (always, madvise, never; empty without).
thp_mode() { sed -n 's/.*\[\(.*\)\].*/\1/p' /sys/kernel/mm/transparent_hugepage/enabled 2>/dev/null || true; }

# tracking_expected: sets tracking (on or off) from the `memory tracking:` line of `stasis
# status`; where CRIU finds soft-dirty tracking in the kernel, stasisd must say on, and under
# huge pages "always" that it tracks by 2 MiB.
tracking_expected() {
  local line
  line=$(cli status | grep -m 1 '^memory tracking:' || true)
  [ -n "$line" ] || fail "stasis status has no 'memory tracking:' line"
  echo "stasis status: $line"
  case ${line#memory tracking: } in
    on*) tracking=on ;;
    off*) tracking=off ;;
    *) fail "stasis status says neither on nor off: $line" ;;
  esac
  local thp
  thp=$(thp_mode)
  if [ "$tracking" = on ] && { [ "$thp" = always ] || grep -q '2 MiB' <<<"$line"; }; then
    [ "$thp" = always ] && grep -q "by 2 MiB" <<<"$line" ||
      fail "transparent huge pages are '$thp' and stasis status says: $line"
  fi
  if [ "$tracking" = off ] && [ "${1:-}" != off ] &&
    "$root/.stasis/criu/bin/criu" check --feature mem_dirty_track >/dev/null 2>&1; then
    fail "memory tracking is off though CRIU finds soft-dirty tracking here: $line"
  fi
}

# unchanged CHECKPOINT_JSON [FIELD]: its stats.bytes_unchanged, or stats.FIELD (0 where the
# JSON leaves a zero out; "missing" where the stats are).
unchanged() {
  python3 -c '
import json, sys
stats = json.loads(sys.argv[1]).get("stats")
print("missing" if stats is None else stats.get(sys.argv[2], 0))' "$1" "${2:-bytes_unchanged}"
}

# expect_unchanged WHAT CHECKPOINT_JSON zero|some [mixed|again]: the checkpoint took no memory
# from the one before (zero), or at least 12 MiB of it (some: most of tracked.py's 24 MiB did
# not change); with mixed (pages rewritten here and there, in windows the one before held as
# one chunk), some unchanged pages reference a part of such a chunk; with again (windows that
# the one before cut so, written again), some were read from the stopped tree instead.
expect_unchanged() {
  local what=$1 bytes from_tree in_part
  bytes=$(unchanged "$2")
  from_tree=$(unchanged "$2" bytes_from_tree)
  in_part=$(unchanged "$2" bytes_in_part)
  echo "$what: $(json id <<<"$2"), bytes_unchanged $bytes of $(json stats.bytes_total <<<"$2") ($in_part in parts of chunks, $from_tree from the tree), frozen $(json stats.frozen_ms <<<"$2") ms, $(json stats.chunks_new <<<"$2") of $(json stats.chunks_total <<<"$2") chunks new"
  [ "$bytes" != missing ] || fail "$what: the checkpoint has no stats"
  case $3 in
    zero) [ "$bytes" = 0 ] || fail "$what: bytes_unchanged $bytes, expected 0 (tracking $tracking)" ;;
    some) [ "$bytes" -ge $((12 << 20)) ] || fail "$what: bytes_unchanged $bytes, expected at least 12 MiB (tracking $tracking)" ;;
  esac
  [ "$3" = some ] || return 0
  if [ "${4:-}" = mixed ] && [ "$in_part" -le 0 ]; then
    fail "$what: no unchanged page beside a written one references a part of a chunk"
  fi
  if [ "${4:-}" = again ] && [ "$from_tree" -le 0 ]; then
    fail "$what: no unchanged page of a window written again was read from the stopped tree"
  fi
}

# tracked_step N: SIGUSR1 to tracked.py, whose step N ends with `phase N sum S`; sets sum=S.
tracked_step() {
  kill -USR1 "$(script_pid tracked.py)"
  wait_for 120 "phase $1 of tracked.py" grep -q "^phase $1 sum " "$log"
  sum=$(sed -n "s/^phase $1 sum //p" "$log" | tail -n 1)
  echo "phase $1: sum $sum"
}

# tracked_verify WANT WHAT: SIGUSR2 to tracked.py; its `verify sum` must be WANT.
tracked_verify() {
  local before got
  before=$(grep -c '^verify sum ' "$log" || true)
  kill -USR2 "$(script_pid tracked.py)"
  wait_for 120 "tracked.py's checksum ($2)" lines_at_least "$log" '^verify sum ' $((before + 1))
  got=$(sed -n 's/^verify sum //p' "$log" | tail -n 1)
  [ "$got" = "$1" ] || fail "$2: tracked.py's memory sums to $got, expected $1"
  echo "$2: sum $got as expected"
}

# ticks_on WHAT: tracked.py ticks at least 3 more times.
ticks_on() {
  wait_for 120 "ticks $1" reached "$log" "tick " $(($(last_number "$log" "tick ") + 3))
}

# tracked_said: what tracked.py said last, besides its ticks (on failure: a Python error, say).
tracked_said() {
  echo "tracked.py, last lines but ticks:"
  grep -a -v '^tick ' "$log" | tail -n 25
}

case_tracked() {
  # Keep the checkpoints this case restores (the default keeps 3 a workload): from a stasisd
  # restarted with --keep-last 4, the fifth checkpoint deletes the first, the parent of the
  # second, which must restore alone.
  restart_stasisd --keep-last 4
  local tracking some=some
  tracking_expected
  [ "$tracking" = on ] || some=zero
  start tracked -- "$py" -u "$workloads/tracked.py"
  trap '[ $? = 0 ] || tracked_said' EXIT
  wait_for 120 "tracked.py's memory" grep -q '^ready sum ' "$log"
  local sum sum1 sum5 ck ck1 ck2
  sum=$(sed -n 's/^ready sum //p' "$log")
  echo "ready: sum $sum"
  wait_for 60 "ticks" reached "$log" "tick " 3
  ck1=$(cli checkpoint --workload tracked --leave-running --json)
  expect_unchanged "checkpoint 1 (the first)" "$ck1" zero
  tracked_step 1
  sum1=$sum
  ck2=$(cli checkpoint --workload tracked --leave-running --json)
  expect_unchanged "checkpoint 2 (after rewriting 10%)" "$ck2" $some mixed
  tracked_step 2
  tracked_step 3
  restart_stasisd --keep-last 4
  kill -0 "$pid" || fail "the workload ended when stasisd restarted"
  ticks_on "after stasisd's restart"
  tracking_expected
  ck=$(cli checkpoint --workload tracked --leave-running --json)
  expect_unchanged "checkpoint 3 (after fork, mremap, munmap and stasisd's restart)" "$ck" zero
  tracked_step 4
  ck=$(cli checkpoint --workload tracked --leave-running --json)
  expect_unchanged "checkpoint 4 (after rewriting 5% again)" "$ck" $some mixed
  tracked_verify "$sum" "after checkpoint 4, left running"
  tracked_step 5
  sum5=$sum
  evict tracked
  expect_unchanged "checkpoint 5 (the eviction, after rewriting 5% once more)" "$ck" $some again
  restore tracked
  ticks_on "after the restore of checkpoint 5"
  tracked_verify "$sum5" "restored from checkpoint 5"
  # The first checkpoint, the second's parent, is gone by now (--keep-last 4), and a collection
  # takes what only it held.
  local id1 id2
  id1=$(json id <<<"$ck1")
  id2=$(json id <<<"$ck2")
  cli gc >/dev/null
  local listed
  listed=$(cli list --workload tracked --json)
  case $listed in
    *"$id1"*) fail "checkpoint 1 ($id1) is still listed after the fifth, with --keep-last 4" ;;
  esac
  kill -KILL "$pid"
  wait_for 60 "end of the killed tree (pid $pid)" gone "$pid"
  r=$(cli restore "$id2" --json)
  pid=$(json pid <<<"$r")
  kill -0 "$pid" 2>/dev/null || fail "pid $pid restored from checkpoint 2 is not running"
  ticks_on "after the restore of checkpoint 2"
  tracked_verify "$sum1" "restored from checkpoint 2 ($id2)"
  cli check --read-data >/dev/null
  restart_stasisd
  echo "tracking $tracking: checksums kept through 5 checkpoints, a restart, an eviction and the restore of checkpoint 2 alone; store checks clean"
}

# cost_round NAME MIB SEED: runs track_cost.py (MIB MiB) as workload NAME, checkpoints it left
# running (a periodic checkpoint), rewrites 10% of it and evicts it; sets frozen, dump, durable
# and kept (bytes_unchanged) of the eviction.
cost_round() {
  start "$1" -- "$py" -u "$workloads/track_cost.py" "$2" "$3"
  wait_for 600 "$2 MiB of track_cost.py" grep -q '^ready ' "$log"
  local periodic
  periodic=$(cli checkpoint --workload "$1" --leave-running --json)
  echo "$1: periodic checkpoint frozen $(json stats.frozen_ms <<<"$periodic") ms, dump $(json stats.dump_ms <<<"$periodic") ms, durable $(json stats.durable_ms <<<"$periodic") ms"
  kill -USR1 "$(script_pid track_cost.py)"
  wait_for 300 "the rewrite of 10%" grep -q '^rewrote 1' "$log"
  evict "$1"
  frozen=$(json stats.frozen_ms <<<"$ck")
  dump=$(json stats.dump_ms <<<"$ck")
  durable=$(json stats.durable_ms <<<"$ck")
  kept=$(unchanged "$ck")
  echo "$1: eviction frozen $frozen ms, dump $dump ms, durable $durable ms, bytes_unchanged $kept of $(json stats.bytes_total <<<"$ck"), $(json stats.bytes_uploaded <<<"$ck") uploaded"
}

# ratio A B: A / B to two decimals.
ratio() { awk -v a="$1" -v b="$2" 'BEGIN { if (b > 0) printf "%.2f", a / b; else print "n/a" }'; }

# On demand only (not in all_cases): what tracking saves an eviction after a periodic checkpoint.
case_track-cost() {
  local mib
  mib=$(awk '/^MemAvailable:/ { m = int($2 / 1024 / 5 / 64) * 64; print (m > 512 ? 512 : m) }' /proc/meminfo)
  [ "$mib" -ge 128 ] || fail "only $mib MiB for the workload: raise the guest's memory (KM_MEM=4096)"
  echo "workload: $mib MiB, half random, half compressible"
  local tracking frozen dump durable kept
  tracking_expected
  [ "$tracking" = on ] || fail "memory tracking is off here, nothing to compare"
  cost_round cost-tracked "$mib" 1
  [ "$kept" != missing ] && [ "$kept" -gt 0 ] || fail "the tracked eviction took nothing from the periodic checkpoint (bytes_unchanged $kept)"
  local on=("$frozen" "$dump" "$durable")
  restart_stasisd --memory-tracking off
  tracking_expected off
  [ "$tracking" = off ] || fail "stasisd started with --memory-tracking off says tracking is $tracking"
  cost_round cost-untracked "$mib" 2
  [ "$kept" = 0 ] || fail "the untracked eviction took $kept bytes from the periodic checkpoint"
  restart_stasisd
  local r_frozen r_dump r_durable
  r_frozen=$(ratio "${on[0]}" "$frozen")
  r_dump=$(ratio "${on[1]}" "$dump")
  r_durable=$(ratio "${on[2]}" "$durable")
  local within=()
  awk -v r="$r_frozen" 'BEGIN { exit !(r <= 0.5) }' && within+=(frozen)
  awk -v r="$r_durable" 'BEGIN { exit !(r <= 0.5) }' && within+=(durable)
  echo "SUMMARY: $mib MiB, eviction after a periodic checkpoint, tracked/untracked: frozen ${on[0]}/$frozen ms (x$r_frozen), dump ${on[1]}/$dump ms (x$r_dump), durable ${on[2]}/$durable ms (x$r_durable); within x0.5: ${within[*]:-neither frozen nor durable}"
}

# evict_round NAME MIB [FLAG...]: runs the benchmark workload as NAME (MIB MiB, half random,
# half compressible, with FLAGs: `--churn` as `stasis-bench kube` runs it in its pod), takes a
# cold checkpoint left running (the periodic one), has it rewrite 10% (in 1 MiB blocks; with
# --churn also a word in every 256 pages, anywhere, and heap churn), evicts it and restores it
# lazily; its checksum must hold. Sets cold and evicted (durable ms) and kept (bytes_unchanged).
evict_round() {
  local name=$1 mib=$2 sum
  shift 2
  start "$name" -- "$bin/stasis-bench-workload" --rss-mib "$mib" --dirty 0.1 "$@"
  wait_for 600 "$mib MiB of the benchmark workload" grep -q '^ready' "$log"
  local ck0 w
  ck0=$(cli checkpoint --workload "$name" --leave-running --json)
  cold=$(json stats.durable_ms <<<"$ck0")
  w=$(script_pid stasis-bench-workload)
  kill -USR1 "$w"
  wait_for 300 "the rewrite of 10%" grep -q '^dirtied ' "$log"
  kill -USR2 "$w"
  wait_for 300 "the checksum" grep -q '^checksum ' "$log"
  sum=$(sed -n 's/^checksum //p' "$log")
  local profiling=
  [ "$(sed -n 's/.*km\.perf=\([^ ]*\).*/\1/p' /proc/cmdline)" = "$name" ] && profiling=$KM_STATE/perf.data
  [ -z "$profiling" ] || start_perf "$profiling"
  evict "$name"
  [ -z "$profiling" ] || stop_perf "$profiling"
  evicted=$(json stats.durable_ms <<<"$ck")
  kept=$(unchanged "$ck")
  echo "$name: cold checkpoint durable $cold ms ($(json stats.bytes_uploaded <<<"$ck0") bytes uploaded); eviction durable $evicted ms, frozen $(json stats.frozen_ms <<<"$ck") ms, $(json stats.bytes_uploaded <<<"$ck") bytes uploaded, bytes_unchanged $kept ($(unchanged "$ck" bytes_from_tree) from the tree)"
  restore "$name" --lazy
  w=$(script_pid stasis-bench-workload)
  kill -USR2 "$w"
  wait_for 300 "the restored checksum" lines_at_least "$log" '^checksum ' 2
  local after
  after=$(sed -n 's/^checksum //p' "$log" | tail -n 1)
  [ "$after" = "$sum" ] || fail "$name: the restored memory's checksum is $after, was $sum"
  kill -KILL "$pid"
  wait_for 60 "end of $name" gone "$pid"
  # The store is on the guest's tmpfs: a round's checkpoints go before the next round.
  local id
  for id in $(cli list --workload "$name" --json | python3 -c '
import json, sys
print(" ".join(c["id"] for c in json.load(sys.stdin)["checkpoints"]))'); do
    cli delete "$id" >/dev/null
  done
  cli gc >/dev/null
}

# start_perf FILE: samples every CPU of the guest into FILE (perf record -a, 499 Hz) until
# stop_perf, or until the case ends (a failure before stop_perf stops it too); waits 1 s for
# perf to start.
start_perf() {
  perf record -a -F 499 -o "$1" >/dev/null 2>&1 &
  echo $! >"$1.pid"
  trap "kill -INT $! 2>/dev/null || true" EXIT
  sleep 1
}

# stop_perf FILE: stops the sampling of start_perf and prints the busiest commands (PERFCOMM)
# and symbols (PERFSYM) of FILE.
stop_perf() {
  trap - EXIT
  kill -INT "$(cat "$1.pid")" 2>/dev/null || true
  wait "$(cat "$1.pid")" || true
  local sort
  for sort in comm comm,dso,sym; do
    perf report -i "$1" --sort "$sort" --stdio 2>/dev/null | grep -v -e '^#' -e '^$' | head -n 40 |
      sed "s/^/PERF$([ "$sort" = comm ] && echo COMM || echo SYM) /" || true
  done
}

# On demand only (not in all_cases): the Kubernetes eviction's shape (stasis-bench kube: a
# cold checkpoint left running, 10% rewritten with heap churn, the eviction), without the
# containerd around it, with tracking and with --memory-tracking off: eviction / cold.
case_evict-cost() {
  [ -x "$bin/stasis-bench-workload" ] || fail "no stasis-bench-workload (cargo build --workspace)"
  local mib
  mib=$(awk '/^MemAvailable:/ { m = int($2 / 1024 / 5 / 64) * 64; print (m > 1024 ? 1024 : m) }' /proc/meminfo)
  [ "$mib" -ge 256 ] || fail "only $mib MiB for the workload: raise the guest's memory (KM_MEM=6144)"
  local tracking cold evicted kept
  tracking_expected
  [ "$tracking" = on ] || fail "memory tracking is off here, nothing to compare"
  evict_round evict-blocks "$mib"
  [ "$kept" != missing ] && [ "$kept" -gt 0 ] || fail "the tracked eviction took nothing from the cold checkpoint"
  local blocks=("$cold" "$evicted")
  evict_round evict-tracked "$mib" --churn
  local on=("$cold" "$evicted")
  restart_stasisd --memory-tracking off
  evict_round evict-blocks-untracked "$mib"
  [ "$kept" = 0 ] || fail "the untracked eviction took $kept bytes from the cold checkpoint"
  local blocks_off=("$cold" "$evicted")
  evict_round evict-untracked "$mib" --churn
  [ "$kept" = 0 ] || fail "the untracked eviction took $kept bytes from the cold checkpoint"
  restart_stasisd
  # shape TRACKED_COLD TRACKED_EVICTED UNTRACKED_COLD UNTRACKED_EVICTED: the line for one shape.
  shape() {
    echo "eviction / cold checkpoint tracked $2/$1 ms (x$(ratio "$2" "$1")), untracked $4/$3 ms (x$(ratio "$4" "$3")); eviction tracked / untracked x$(ratio "$2" "$4")"
  }
  echo "SUMMARY: $mib MiB, transparent huge pages '$(thp_mode)', durable times. 10% in 1 MiB blocks: $(shape "${blocks[@]}" "${blocks_off[@]}"). With heap churn: $(shape "${on[@]}" "$cold" "$evicted"). Targets: eviction / cold x0.2, tracked / untracked x0.5"
}

# start_stasisd [FLAG...]: starts stasisd on the guest's state and store (with FLAGs besides),
# in a session of its own (a case's timeout does not end it), its pid in $KM_STATE/stasisd.pid;
# returns once it serves, or fails after 180 s. Its log goes on in $KM_STATE/stasisd.log.
start_stasisd() {
  echo "stasisd started with: ${*:-(the default flags)}" >>"$KM_STATE/stasisd.log"
  setsid bash -c 'echo $$ >"$KM_STATE/stasisd.pid"; exec "$@"' stasisd \
    "$bin/stasisd" --socket "$KM_STATE/stasisd.sock" --state-dir "$KM_STATE/state" \
    --store "file://$KM_STATE/store" --criu "$root/.stasis/criu/bin/criu" --gc-grace-secs 0 "$@" \
    >>"$KM_STATE/stasisd.log" 2>&1 </dev/null &
  local started=$SECONDS
  until st status >/dev/null 2>&1; do
    [ $((SECONDS - started)) -le 180 ] || return 1
    sleep 1
  done
}

# ended PID: PID is gone or a zombie.
ended() { [ ! -e "/proc/$1" ] || [ "$(sed 's/.*) \(.\).*/\1/' "/proc/$1/stat" 2>/dev/null)" = Z ]; }

# restart_stasisd [FLAG...]: stops stasisd (SIGTERM, as systemd does) and starts it again on the
# same state and store, with FLAGs besides the usual ones. Workloads run on meanwhile.
restart_stasisd() {
  local old
  old=$(cat "$KM_STATE/stasisd.pid")
  kill -TERM "$old" || fail "cannot signal stasisd (pid $old)"
  wait_for 120 "end of stasisd (pid $old) after SIGTERM" ended "$old"
  start_stasisd "$@" || fail "stasisd does not serve 180 s after its restart with: ${*:-the default flags}"
  echo "stasisd restarted (pid $old -> $(cat "$KM_STATE/stasisd.pid"))${1:+ with $*}"
}

# kernel_before MAJOR MINOR: whether the running kernel is older than MAJOR.MINOR.
kernel_before() {
  local major minor
  IFS=. read -r major minor _ <<<"$(uname -r)"
  [ "$major" -lt "$1" ] || { [ "$major" = "$1" ] && [ "${minor%%[!0-9]*}" -lt "$2" ]; }
}

# proc_state PID: the state letter of process PID (R, S, T, ...).
proc_state() { sed -n 's/^State:[[:space:]]*\([A-Za-z]\).*/\1/p' "/proc/$1/status"; }

case_rseq() {
  # Started outside stasisd, in a session of its own and without glibc.pthread.rseq=0, so its
  # glibc (2.35 or later: the host's, which the guest runs) registered rseq in it. It writes its
  # pid, then a tick every 0.2 s, opening its log each time.
  local ticks=$KM_STATE/rseq-ticks.log
  env -u GLIBC_TUNABLES setsid "$py" -c '
import os, sys, time
with open(sys.argv[1], "a") as f:
    print("pid", os.getpid(), file=f)
n = 0
while True:
    n += 1
    with open(sys.argv[1], "a") as f:
        print("tick", n, file=f)
    time.sleep(0.2)' "$ticks" </dev/null >/dev/null 2>&1 &
  wait_for 60 "ticks" reached "$ticks" "tick " 5
  local pid last
  pid=$(sed -n 's/^pid //p' "$ticks")
  ! grep -q -a GLIBC_TUNABLES "/proc/$pid/environ" || fail "the process got GLIBC_TUNABLES"
  if kernel_before 5 13; then
    local err=$KM_STATE/rseq.err out why
    if out=$(st checkpoint "$pid" --json 2>"$err"); then
      fail "the checkpoint of a process with rseq succeeded on $(uname -r): $out"
    fi
    why=$(head -n 1 "$err")
    echo "refused: $why"
    grep -q 'rseq' <<<"$why" || fail "the refusal does not name rseq: $why"
    grep -q 'nothing was touched' <<<"$why" || fail "the refusal is not an up-front one: $why"
    ! grep -q 'get_rseq_conf' "$KM_STATE/stasisd.log" || fail "CRIU ran on it: $(grep -m 1 get_rseq_conf "$KM_STATE/stasisd.log")"
    kill -0 "$pid" 2>/dev/null || fail "the refused process $pid is gone"
    [ "$(proc_state "$pid")" != T ] || fail "the refused process $pid is stopped"
    last=$(last_number "$ticks" "tick ")
    wait_for 30 "ticks past $last after the refusal" reached "$ticks" "tick " $((last + 10))
    consecutive "$ticks" "tick " || fail "ticks not consecutive: $(consecutive "$ticks" "tick ")"
    echo "process $pid refused, state $(proc_state "$pid"), ticked on from $last to $(last_number "$ticks" "tick ")"
  else
    local ck id
    ck=$(cli checkpoint "$pid" --json)
    id=$(json id <<<"$ck")
    wait_for 60 "end of the evicted process (pid $pid)" gone "$pid"
    last=$(last_number "$ticks" "tick ")
    r=$(cli restore "$id" --json)
    pid=$(json pid <<<"$r")
    kill -0 "$pid" 2>/dev/null || fail "restored pid $pid is not running"
    wait_for 120 "ticks past $last after the restore" reached "$ticks" "tick " $((last + 10))
    consecutive "$ticks" "tick " || fail "ticks not consecutive: $(consecutive "$ticks" "tick ")"
    echo "process with rseq checkpointed ($id) at tick $last, restored as $pid, ticked on to $(last_number "$ticks" "tick ")"
  fi
  kill "$pid"
}

# ---------------------------------------------------------------------------------------------
# Inside the guest: pid 1.
# ---------------------------------------------------------------------------------------------

guest_mounts() {
  mountpoint -q /proc || mount -t proc proc /proc
  mountpoint -q /sys || mount -t sysfs sysfs /sys
  mountpoint -q /dev || mount -t devtmpfs devtmpfs /dev
  mkdir -p /dev/pts /dev/shm
  mount -t devpts -o newinstance,ptmxmode=0666 devpts /dev/pts
  mount -t tmpfs -o mode=1777 tmpfs /dev/shm
  mount -t tmpfs -o mode=0755 tmpfs /run
  mount -t tmpfs -o mode=1777 tmpfs /tmp
  mount -t tmpfs -o mode=1777 tmpfs /var/tmp
  # stasisd installs each build of stasis-init under /var/lib/stasis/init, which the host's
  # read-only root holds only for builds the host ran (not a release build's, on a fresh clone
  # not even the directory).
  if [ -d /var/lib/stasis ]; then
    mount -t tmpfs -o mode=0700 tmpfs /var/lib/stasis
  else
    mount -t tmpfs -o mode=0755 tmpfs /var/lib
  fi
  mount -t cgroup2 cgroup2 /sys/fs/cgroup
  ip link set lo up
}

guest_main() {
  export PATH=/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin HOME=/tmp LANG=C.UTF-8
  export PYTHONDONTWRITEBYTECODE=1 NO_COLOR=1
  set +e
  guest_mounts
  export KM_STATE=/tmp/km
  mkdir -p "$KM_STATE"
  local kernel
  kernel=$(uname -r)
  echo "KMINFO kernel $kernel"
  echo "KMINFO modules: $(cut -d' ' -f1 /proc/modules | sort | tr '\n' ' ')"
  local criu=$root/.stasis/criu/bin/criu
  echo "KMINFO transparent huge pages: $(thp_mode)"
  echo "KMINFO criu check: $("$criu" check 2>&1 | tail -n 1)"
  for feature in uffd-noncoop mem_dirty_track pidfd_store; do
    echo "KMINFO criu feature $feature: $("$criu" check --feature "$feature" 2>&1 | tail -n 1)"
  done
  start_stasisd
  grep -a -e 'engine::start' -e ERROR "$KM_STATE/stasisd.log" | sed 's/^/KMINFO stasisd: /'
  local cases
  cases=$(sed -n 's/.*km\.cases=\([^ ]*\).*/\1/p' /proc/cmdline | tr , ' ')
  for c in ${cases:-$all_cases}; do
    local t0=$SECONDS result
    if ! st status >/dev/null 2>&1; then
      result="fail: stasisd is not serving"
    else
      timeout 900 bash "$self" --case "$c" >"$KM_STATE/case-$c.log" 2>&1
      local rc=$?
      if [ $rc = 0 ]; then
        local summary
        summary=$(sed -n 's/^SUMMARY: //p' "$KM_STATE/case-$c.log" | tail -n 1)
        result="pass ($((SECONDS - t0)) s)${summary:+: $summary}"
      else
        local reason
        reason=$(sed -n 's/^REASON: //p' "$KM_STATE/case-$c.log" | tail -n 1)
        [ $rc != 124 ] || reason="timed out after 900 s${reason:+; $reason}"
        [ -n "$reason" ] || reason=$(grep . "$KM_STATE/case-$c.log" | tail -n 1)
        result="fail: $reason"
      fi
      sed "s/^/KMLOG $c: /" "$KM_STATE/case-$c.log"
      if [ $rc != 0 ]; then
        tail -n 40 "$KM_STATE/stasisd.log" | sed "s/^/KMLOG $c stasisd: /"
      fi
    fi
    echo "KMRESULT $c $result"
  done
  echo "KMDONE"
  sync
  echo o >/proc/sysrq-trigger
  sleep 60
}

# ---------------------------------------------------------------------------------------------
# On this machine: fetch, build, boot, report.
# ---------------------------------------------------------------------------------------------

km_dir=$root/.stasis/kernel-matrix

# apt_opts SUITE: the apt-get/apt-cache options of a private sources list for SUITE.
apt_opts() {
  local dir=$km_dir/apt/$1
  echo -o "Dir::Etc::SourceList=$dir/sources.list" -o "Dir::Etc::SourceParts=-" \
    -o "Dir::State::Lists=$dir/lists" -o "Dir::Cache::Archives=$dir/debs" -o "APT::Get::List-Cleanup=0" -o "APT::Sandbox::User=root"
}

apt_update() {
  local dir=$km_dir/apt/$1
  mkdir -p "$dir/lists/partial" "$dir/debs/partial"
  echo "deb http://deb.debian.org/debian $1 main" >"$dir/sources.list"
  # shellcheck disable=SC2046
  apt-get $(apt_opts "$1") -qq update >&2
}

# fetch_deb SUITE PACKAGE DEST: downloads PACKAGE from SUITE and unpacks it into DEST.
fetch_deb() {
  local dir=$km_dir/apt/$1
  rm -f "$dir"/debs/*.deb
  # shellcheck disable=SC2046
  (cd "$dir/debs" && apt-get $(apt_opts "$1") -qq download "$2" >&2)
  mkdir -p "$3"
  dpkg -x "$dir"/debs/*.deb "$3"
  rm -f "$dir"/debs/*.deb
}

suite_of() {
  case $1 in
    5.10) echo bullseye ;;
    6.1) echo bookworm ;;
    6.12) echo trixie ;;
    *) echo "kernel-matrix: unknown series $1 (5.10, 6.1 or 6.12)" >&2; return 1 ;;
  esac
}

# fetch_kernel SERIES: unpacks the newest amd64-unsigned kernel of SERIES (once).
fetch_kernel() {
  local series=$1 suite dest=$km_dir/kernels/$1
  suite=$(suite_of "$series")
  if [ -f "$dest/.package" ] && [ -z "${KM_REFRESH:-}" ]; then return; fi
  apt_update "$suite"
  local pattern pkg
  pattern="^linux-image-${series//./\\.}[.0-9]*[-+][-+0-9a-z]*-amd64-unsigned\$"
  # shellcheck disable=SC2046
  pkg=$(apt-cache $(apt_opts "$suite") pkgnames linux-image- | grep -E "$pattern" | grep -v -e cloud -e '-rt-' |
    sort -V | tail -n 1)
  [ -n "$pkg" ] || { echo "kernel-matrix: no $pattern in $suite" >&2; return 1; }
  echo "kernel-matrix: fetching $pkg from $suite" >&2
  rm -rf "$dest.tmp"
  fetch_deb "$suite" "$pkg" "$dest.tmp"
  echo "$pkg" >"$dest.tmp/.package"
  rm -rf "$dest" && mv "$dest.tmp" "$dest"
}

# busybox_static: the path of a statically linked busybox (fetched when the system's is not).
busybox_static() {
  if [ -x /bin/busybox ] && ! ldd /bin/busybox >/dev/null 2>&1; then
    echo /bin/busybox
    return
  fi
  local dest=$km_dir/busybox
  if [ ! -x "$dest/bin/busybox" ]; then
    apt_update bookworm
    rm -rf "$dest"
    fetch_deb bookworm busybox-static "$dest"
  fi
  echo "$dest/bin/busybox"
}

# The modules the guest loads from its initramfs, by name (their dependencies come along).
# Built-in ones (and ones this kernel does not have) are skipped.
guest_modules="virtio_pci virtio_blk 9pnet_virtio 9p crc32c_generic
unix_diag inet_diag tcp_diag udp_diag raw_diag netlink_diag packet_diag af_packet_diag
nf_tables nf_tables_inet nft_ct nft_counter nft_reject_inet nft_chain_route_ipv4
nft_chain_route_ipv6 nft_compat nft_nat nft_chain_nat nft_fib_inet nft_limit nft_hash
nft_set_hash nft_set_rbtree nft_set_bitmap nft_meta nft_socket"

# modinfo_depends KO: the modules KO depends on, from its .modinfo: those it links against and
# those it asks for before itself ("softdep=pre:", where they are module names).
modinfo_depends() {
  strings -n 3 "$1" | sed -n -e 's/^depends=//p' -e 's/^softdep=pre: *\([^:]*\).*/\1/p' | tr ', ' '\n\n' | grep . || true
}

# build_initramfs SERIES OUT: the guest's initramfs for the kernel of SERIES.
build_initramfs() {
  local kdir=$km_dir/kernels/$1 out=$2 work
  work=$(mktemp -d)
  local moddir
  moddir=$( (find "$kdir/lib/modules" "$kdir/usr/lib/modules" -mindepth 1 -maxdepth 1 -type d 2>/dev/null || true) |
    head -n 1)
  [ -n "$moddir" ] || { echo "kernel-matrix: no modules in $kdir" >&2; return 1; }
  mkdir -p "$work/bin" "$work/proc" "$work/sys" "$work/dev" "$work/newroot" "$work/modules"
  cp "$(busybox_static)" "$work/bin/busybox"
  # name (with _ for -) -> path of every module of the package
  local index=$work/index
  find "$moddir" -name '*.ko*' |
    awk '{ n = $0; sub(".*/", "", n); sub("[.]ko.*$", "", n); gsub("-", "_", n); print n, $0 }' >"$index"
  local -A seen=()
  : >"$work/modules.load"
  add_module() {
    local name=${1//-/_} path
    [ -n "$name" ] && [ -z "${seen[$name]:-}" ] || return 0
    seen[$name]=1
    path=$(awk -v n="$name" '$1 == n { print $2; exit }' "$index")
    [ -n "$path" ] || return 0
    local ko=$work/modules/$name.ko
    case $path in
      *.xz) xz -dc "$path" >"$ko" ;;
      *.zst) zstd -qdc "$path" >"$ko" ;;
      *.gz) gzip -dc "$path" >"$ko" ;;
      *) cp "$path" "$ko" ;;
    esac
    local dep
    for dep in $(modinfo_depends "$ko"); do add_module "$dep"; done
    echo "$name.ko" >>"$work/modules.load"
  }
  local m
  for m in $guest_modules; do add_module "$m"; done
  cat >"$work/init" <<'INIT'
#!/bin/busybox sh
/bin/busybox --install -s /bin
export PATH=/bin
mount -t proc proc /proc
mount -t sysfs sysfs /sys
mount -t devtmpfs devtmpfs /dev
for m in $(cat /modules.load); do
  insmod /modules/$m 2>/insmod.err || echo "KMINFO insmod $m: $(cat /insmod.err)"
done
repo=$(sed -n 's/.*km\.repo=\([^ ]*\).*/\1/p' /proc/cmdline)
if ! mount -t 9p -o trans=virtio,version=9p2000.L,ro,cache=loose,msize=512000 hostroot /newroot; then
  echo "KMRESULT boot fail: cannot mount the host's root over 9p"
  echo o >/proc/sysrq-trigger
fi
mount -o move /proc /newroot/proc
mount -o move /sys /newroot/sys
mount -o move /dev /newroot/dev
exec switch_root /newroot /usr/bin/env KM_ROOT="$repo" KM_BIN="$repo/.stasis/kernel-matrix/bin" \
  /bin/bash "$repo/.stasis/kernel-matrix/bin/kernel-matrix.sh" --guest
INIT
  chmod +x "$work/init"
  (cd "$work" && rm -f index && find . | "$work/bin/busybox" cpio -o -H newc 2>/dev/null | gzip -1) >"$out"
  echo "kernel-matrix: initramfs with $(wc -l <"$work/modules.load") modules" >&2
  rm -rf "$work"
}

# run_kernel SERIES: boots SERIES's kernel and runs the cases; appends its rows to $table.
run_kernel() {
  local series=$1 kdir=$km_dir/kernels/$1
  local vmlinuz
  vmlinuz=$(find "$kdir/boot" -name 'vmlinuz-*' | head -n 1)
  local release=${vmlinuz##*/vmlinuz-}
  local initrd=$km_dir/initrd-$series.cpio.gz console=$km_dir/console-$series.log
  build_initramfs "$series" "$initrd"
  local cases=${KM_CASES:-$all_cases}
  echo "kernel-matrix: booting $release (console: $console)" >&2
  local t0=$SECONDS rc=0
  timeout "${KM_TIMEOUT:-1800}" qemu-system-x86_64 -accel tcg,thread=multi -M pc -cpu max \
    -smp "${KM_SMP:-2}" -m "${KM_MEM:-1536}" -display none -monitor none -no-reboot \
    -serial "file:$console" -nic none \
    -kernel "$vmlinuz" -initrd "$initrd" \
    -append "console=ttyS0 loglevel=3 panic=-1 km.repo=$root km.cases=${cases// /,}${KM_THP:+ transparent_hugepage=$KM_THP}${KM_PERF:+ km.perf=$KM_PERF}" \
    -virtfs "local,path=/,mount_tag=hostroot,security_model=none,readonly=on,multidevs=remap" \
    </dev/null || rc=$?
  echo "kernel-matrix: $release done in $((SECONDS - t0)) s (qemu exit $rc)" >&2
  tr -d '\r' <"$console" | grep -a '^KMINFO' | sed "s/^KMINFO /  [$release] /" >&2 || true
  local c result
  for c in $cases; do
    result=$(tr -d '\r' <"$console" | sed -n "s/^KMRESULT $c //p" | tail -n 1)
    if [ -z "$result" ]; then
      result=$(tr -d '\r' <"$console" | sed -n 's/^KMRESULT boot //p' | tail -n 1)
      [ -n "$result" ] || { [ $rc = 124 ] && result="fail: not reached (the guest timed out)"; } ||
        result="fail: not reached (see $console)"
    fi
    printf '| %s | %s | %s |\n' "$release" "$c" "$result" >>"$table"
  done
}

host_main() {
  [ "$(id -u)" = 0 ] || { echo "kernel-matrix: run as root (CRIU in the guest runs as its root)" >&2; exit 1; }
  local series_list=("$@")
  [ ${#series_list[@]} -gt 0 ] || series_list=(5.10 6.1 6.12)
  for s in "${series_list[@]}"; do suite_of "$s" >/dev/null; done
  if ! command -v qemu-system-x86_64 >/dev/null; then
    apt-get update -qq
    DEBIAN_FRONTEND=noninteractive apt-get install -y -qq --no-install-recommends qemu-system-x86 >/dev/null
  fi
  [ -x "$root/.stasis/criu/bin/criu" ] || "$root/scripts/setup-criu.sh" >/dev/null
  if [ -n "${KM_PERF:-}" ] && ! command -v perf >/dev/null; then
    echo "kernel-matrix: KM_PERF needs perf on this machine (the guest runs the host's)" >&2
    exit 1
  fi
  local b built=$root/target/${KM_PROFILE:-debug}
  for b in stasisd stasis stasis-init stasis-lazy-guard; do
    [ -x "$built/$b" ] || { echo "kernel-matrix: build first (cargo build --workspace): no $built/$b" >&2; exit 1; }
  done
  mkdir -p "$km_dir"
  exec 9>"$km_dir/lock"
  flock -n 9 || { echo "kernel-matrix: another run holds $km_dir/lock" >&2; exit 1; }
  # What the guest runs, copied now (stasisd finds stasis-init and the lazy guard beside it).
  rm -rf "$km_dir/bin" && mkdir -p "$km_dir/bin"
  cp "$self" "$km_dir/bin/kernel-matrix.sh"
  for b in stasisd stasis stasis-init stasis-lazy-guard; do cp "$built/$b" "$km_dir/bin/"; done
  # The benchmark workload, for evict-cost.
  cp "$built/stasis-bench-workload" "$km_dir/bin/" 2>/dev/null || true
  table=$(mktemp)
  for s in "${series_list[@]}"; do
    fetch_kernel "$s"
    run_kernel "$s"
  done
  local results=${KM_RESULTS:-$km_dir/results.txt}
  {
    echo "Kernel matrix, $(date -u '+%Y-%m-%d %H:%M UTC'), $(git -C "$root" rev-parse --short HEAD 2>/dev/null), qemu TCG"
    echo
    echo "| kernel | test | result |"
    echo "|---|---|---|"
    cat "$table"
  } | tee "$results"
  rm -f "$table"
  ! grep -q '| fail' "$results"
}

case ${1:-} in
  --guest) guest_main ;;
  --fetch)
    shift
    for s in "${@:-5.10 6.1 6.12}"; do fetch_kernel "$s"; done
    ;;
  --case)
    export PATH=/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin
    "case_$2"
    ;;
  *) host_main "$@" ;;
esac
