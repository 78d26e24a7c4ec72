//! The kernel as the engine's jobs see it: processes, their state, memory, counters and
//! signals, what a tree holds, and its sockets. [`LinuxHost`] (kernel.rs) does it through
//! `linux/`, and is the engine's only way there (scripts/check-seams.sh checks it); the unit
//! tests of the jobs' failure paths use [`fake::FakeHost`], so those paths run without root,
//! CRIU or a workload.

mod kernel;

#[cfg(test)]
pub(super) mod fake;

use std::collections::HashSet;
use std::io;
use std::path::Path;

pub use kernel::LinuxHost;
use nix::sys::signal::Signal;

use super::inspect::TreeInfo;
use super::sockets::{Connection, TreeSockets};

/// What the engine's jobs ask of the kernel.
pub trait Host: Send + Sync {
    /// Whether `pid` exists and is not a zombie.
    fn is_running(&self, pid: i32) -> bool;
    /// The command line of `pid`.
    fn command(&self, pid: i32) -> io::Result<Vec<String>>;
    /// What the tree rooted at `root` holds, and so how CRIU must dump it.
    fn inspect(&self, root: i32) -> io::Result<TreeInfo>;
    /// What `pid` is, if it may not be checkpointed at all: init, a kernel thread, or stasisd
    /// itself.
    fn untouchable(&self, pid: i32) -> Option<String>;
    /// Why CRIU cannot record the session of `pid`, if it cannot (session 0, whose leader is
    /// outside this pid namespace).
    fn unrecordable_session(&self, pid: i32) -> Option<String>;
    /// The pid of `pid` inside the pid namespace of which `root` is the init.
    fn pid_inside(&self, pid: i32, root: i32) -> Option<i32>;
    /// Resident memory of `pids` together.
    fn resident_bytes(&self, pids: &[i32]) -> u64;
    /// The private writable mappings of `pid`, as sorted `[start, end)` ranges (none when they
    /// cannot be read): where a CUDA checkpoint puts device memory.
    fn private_writable_ranges(&self, pid: i32) -> Vec<(u64, u64)>;
    /// What `pid` has used so far (zero for what cannot be read: a process that is gone).
    fn usage(&self, pid: i32) -> Usage;
    /// This machine's memory, if it can be read.
    fn memory_total(&self) -> Option<u64>;
    /// Which of `pids` are stopped (job control) now.
    fn stopped(&self, pids: &[i32]) -> Vec<i32>;
    /// Which of `pids` a process traces (a CRIU at work on them).
    fn traced(&self, pids: &[i32]) -> Vec<i32>;
    /// The roots of the tree that CRIU (process `criu`, or its launcher) is restoring, as far
    /// as they can be told before CRIU names them.
    fn restoring_roots(&self, criu: i32) -> Vec<i32>;
    /// Every process of the trees rooted at `roots`, roots first (children forked since a
    /// tree was inspected included).
    fn trees(&self, roots: &[i32]) -> Vec<i32>;
    /// Sends `signal` to each of `pids`, ignoring those that are gone.
    fn signal(&self, pids: &[i32], signal: Signal);
    /// When process `pid` started (clock ticks since boot): with the pid, it names one process,
    /// so a pid reused by another process can be told apart.
    fn start_time(&self, pid: i32) -> Option<u64>;
    /// Which of `pids` use CUDA, as far as their mappings and descriptors tell.
    fn cuda_candidates(&self, pids: &[i32]) -> Vec<i32>;
    /// Which of `pids` hold NVIDIA device files (open or mapped).
    fn nvidia_device_holders(&self, pids: &[i32]) -> Vec<i32>;
    /// The sockets `pids` hold (see `sockets::survey`).
    fn sockets(&self, pids: &[i32]) -> TreeSockets;
    /// Takes the TCP sockets of `pids` out of repair mode (see `sockets::leave_repair`).
    fn leave_repair(&self, pids: &[i32], reuse_addr: &HashSet<u64>) -> (Vec<Connection>, Vec<String>);
    /// The root process of the tree in the workload cgroup at `path` (the one whose parent is
    /// outside it), if the cgroup holds one.
    fn cgroup_root(&self, path: &Path) -> Option<i32>;
    /// Removes the workload cgroup at `path` if it is empty (a busy or missing one is left).
    fn remove_empty_cgroup(&self, path: &Path);
    /// Whether this kernel gives a userfaultfd with the events CRIU's lazy restore needs
    /// (fork, remap and unmap), and if not why.
    fn userfaultfd_events(&self) -> Result<(), String>;
    /// Whether this kernel tracks soft-dirty pages (CRIU's memory tracking needs it), and if
    /// not why.
    fn soft_dirty(&self) -> Result<(), String>;
    /// Whether stasisd can copy a descriptor of another process (pidfd_getfd), and if not why.
    fn pidfd_getfd(&self) -> Result<(), String>;
    /// The CPU's user-space instruction-set extensions (see `proc::cpu_isa_flags`).
    fn cpu_flags(&self) -> std::collections::BTreeSet<String>;
    /// This node's name and kernel release, for manifests.
    fn node_name(&self) -> String;
    fn kernel_release(&self) -> String;
}

/// What a process has used so far, for telling idle workloads from busy ones.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct Usage {
    /// CPU time of every thread, in nanoseconds.
    pub cpu_ns: u64,
    /// Bytes read by `read`-like calls (`rchar`), from anything.
    pub read_bytes: u64,
}
