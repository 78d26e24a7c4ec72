#!/usr/bin/env bash
# The kernel seam holds (issue 25, item 2): the engine reaches the kernel (/proc, signals,
# sockets, netlink, cgroups, programs of the system) through `Host` (daemon/src/engine/host/),
# so its unit tests can run it on FakeHost. Fails, listing the lines, when a file of
# daemon/src/engine/ names `linux::` other than as allowed below.
set -euo pipefail
cd "$(dirname "$0")/.."
engine=daemon/src/engine

# The seam's real implementation: these files are where the engine calls linux/.
seam=(
  host/kernel.rs # LinuxHost: each method is a call into linux/ (or into the two below); its
                 # Watches too (host/watch.rs), for idle workloads, its Userfaults
                 # (host/faults.rs), for lazily restored memory, its NetworkLocks
                 # (host/locks.rs), for the locks CRIU leaves on connections, and its
                 # Containers (host/containers.rs), for Kubernetes containers' namespaces,
                 # cgroups, pids and descriptors
  host/container_cuda.rs # Containers::cuda_in: the CUDA driver inside a container, reached
                 # by running the pod bundle's helper there (pids translated through /proc)
  inspect.rs     # Host::inspect: what a tree holds, read from /proc
  unsupported.rs # Host::inspect's refusals: what of a tree CRIU cannot dump
  sockets/mod.rs # Host::sockets and Host::leave_repair: a tree's sockets, read from /proc and
                 # sock_diag, and taken out of TCP repair mode
)

# What of linux/ touches no kernel state the fakes stand for, so any engine file may name it.
pure=(
  'net::SocketKind'      # an enum of socket kinds and their names
  'net::SocketTable'     # a namespace's sockets as read (Host::socket_table reads them)
  'net::SocketEntry'     # one row of it
  'net::WaitingInput'    # input a tree's sockets hold, as read (Host::waiting_input reads it)
  'port_watch::MAX_PORTS' # a constant
  'uffd::FillError'      # an error type
  'uffd::Event'          # what a userfaultfd says: an enum (Userfaults, host/faults.rs)
  'reaper::'             # the reaper is injected (parts.rs Deps); Reaper::default() reaps nothing,
                         # which is what the unit tests run the engine with
  'durable_file::'       # writes of stasisd's own state files (registry, records), atomically;
  'private_dir::'        # unit tests give the engine a state directory in a tempdir
  'mounts::detach_beneath' # stasisd's own work directories (StateDir): what a killed CRIU left
                         # mounted in one (its cgroup yard) is detached before it is removed
  'sys::ChildSetup'      # what a child is set up with before exec: plain data (Host::spawn)
  'init_program::name_of' # the name an installed stasis-init travels under: a file name's prefix
  'pty::is_tty_key'      # whether CRIU's key of an external file names a terminal: a string's prefix
  'sock_diag::TcpSocketInfo' # what sock_diag says of a socket: a state and a count (Watches::tcp_sockets)
  'sock_diag::TCP_ESTABLISHED' # a constant
  'iptables::unlock_commands' # the iptables commands deleting CRIU's rules for a connection,
                              # built, not run (NetworkLocks::run_iptables runs them)
)

# Outside the seam for good (issue 25, item 2): the lines naming linux:: each file may still
# have, each saying why. A count may only go down; lower it here when it does.
declare -A left=(
  # its unit test, root only, makes a real nftables table to see the sweep delete it; the
  # sweep itself deletes through the host (NetworkLocks)
  [sockets/left_locks.rs]=1
  # the default path of CRIU, looked up in PATH while the settings are resolved, before any
  # engine or host exists: a file lookup, not kernel state
  [settings.rs]=1
)

is_seam() {
  local f
  for f in "${seam[@]}"; do [ "$1" = "$f" ] && return 0; done
  return 1
}

status=0
while IFS= read -r file; do
  rel=${file#"$engine"/}
  is_seam "$rel" && continue
  # Lines naming linux:: (comments aside) once the pure items are taken out.
  offending=$(grep -n 'linux::' "$file" | grep -Ev '^[0-9]+:[[:space:]]*//' || true)
  for p in "${pure[@]}"; do
    offending=$(printf '%s\n' "$offending" | sed -E "s/linux::${p}//g")
  done
  offending=$(printf '%s\n' "$offending" | grep 'linux::' || true)
  [ -z "$offending" ] && continue
  count=$(printf '%s\n' "$offending" | wc -l)
  allowed=${left[$rel]:-0}
  if [ "$count" -gt "$allowed" ]; then
    echo "$file calls linux:: outside the kernel seam ($count lines, $allowed allowed); go through Host (engine/host/):" >&2
    printf '%s\n' "$offending" | sed "s|^|  $file:|" >&2
    status=1
  elif [ "$count" -lt "$allowed" ]; then
    echo "note: $rel now has $count lines naming linux::; lower its count in $0 to $count" >&2
  fi
done < <(find "$engine" -name '*.rs' | sort)
exit $status
