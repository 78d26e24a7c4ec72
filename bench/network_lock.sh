#!/usr/bin/env bash
# How long a tree with established TCP connections stays frozen during a checkpoint, with
# CRIU's nftables network lock and with its iptables lock: one stasisd per lock, each
# checkpointing (--leave-running) its own copy of a process holding N loopback connections to
# a peer outside the tree, alternating, R rounds. Prints each round's frozen_ms.
#
# Needs root, a built workspace (cargo build), and iptables installed (scripts/test.sh
# installs it; this script does not). Usage: N=100 R=5 bench/network_lock.sh
set -euo pipefail
root=$(cd "$(dirname "$0")/.." && pwd)
n=${N:-100} rounds=${R:-5}
bin=$root/target/debug
work=$(mktemp -d)
conns=$root/bench/network_lock_conns.py
port=$(python3 -c 'import socket; s = socket.socket(); s.bind(("127.0.0.1", 0)); print(s.getsockname()[1])')
pids=()
cleanup() {
  pkill -f "$conns client" || true
  kill "${pids[@]}" 2>/dev/null || true
  rm -rf "$work"
}
trap cleanup EXIT
python3 "$conns" peer "$port" &
pids+=($!)
for lock in nftables iptables; do
  mkdir "$work/$lock"
  "$bin/stasisd" --socket "$work/$lock/s.sock" --state-dir "$work/$lock/state" \
    --store "file://$work/$lock/store" --network-lock "$lock" --keep-last 0 >"$work/$lock/log" 2>&1 &
  pids+=($!)
done
stasis() { "$bin/stasis" --socket "$work/$1/s.sock" "${@:2}"; }
for lock in nftables iptables; do
  for _ in $(seq 100); do stasis "$lock" status >/dev/null 2>&1 && break; sleep 0.1; done
  stasis "$lock" run --workload conns -- python3 "$conns" client "$port" "$n" >/dev/null
done
sleep 2
for round in $(seq "$rounds"); do
  for lock in nftables iptables; do
    frozen=$(stasis "$lock" checkpoint --workload conns --leave-running --json |
      python3 -c 'import json, sys; print(json.load(sys.stdin)["stats"]["frozen_ms"])')
    echo "$lock round $round: frozen $frozen ms ($n connections)"
  done
done
