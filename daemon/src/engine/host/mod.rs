//! The kernel as the engine's jobs see it: processes, their state, memory, counters and
//! signals, what a tree holds, and its sockets. [`LinuxHost`] (kernel.rs) does it through
//! `linux/`, and is the engine's only way there (scripts/check-seams.sh checks it); the unit
//! tests of the jobs' failure paths use [`fake::FakeHost`], so those paths run without root,
//! CRIU or a workload.

mod container_cuda;
mod containers;
mod faults;
mod kernel;
mod locks;
mod watch;

#[cfg(test)]
pub(super) mod fake;
#[cfg(test)]
mod fake_containers;
#[cfg(test)]
mod fake_faults;
#[cfg(test)]
mod fake_locks;
#[cfg(test)]
mod fake_programs;
#[cfg(test)]
mod rseq_tests;
#[cfg(test)]
mod tests;

use std::collections::HashSet;
use std::fs::File;
use std::io;
use std::os::fd::OwnedFd;
use std::path::{Path, PathBuf};
use std::process::Command;

pub use containers::Containers;
pub use faults::{FaultEvent, FaultFd, Userfaults};
pub use kernel::LinuxHost;
pub use locks::NetworkLocks;
use nix::sys::signal::Signal;
pub use watch::{Hold, PortUses, TcpSockets, Watches};

use super::inspect::{self, TreeInfo};
use super::sockets::{Connection, TreeSockets};
use crate::linux::net::SocketTable;
use crate::linux::net::WaitingInput;
use crate::linux::sys::ChildSetup;

/// What the engine's jobs ask of the kernel (and, for idle workloads, [`Watches`]; for lazily
/// restored memory, [`Userfaults`]; for CRIU's network locks, [`NetworkLocks`]; for Kubernetes
/// containers, [`Containers`]).
pub trait Host: Watches + Userfaults + NetworkLocks + Containers {
    /// Whether `pid` exists and is not a zombie.
    fn is_running(&self, pid: i32) -> bool;
    /// The command line of `pid`.
    fn command(&self, pid: i32) -> io::Result<Vec<String>>;
    /// What the tree rooted at `root` holds, and so how CRIU must dump it: what
    /// [`Host::survey_tree`] finds, refused (`TreeInfo::unsupported`) also where this kernel
    /// keeps CRIU from dumping what its programs do (see `inspect::kernel_refusal`).
    fn inspect(&self, root: i32) -> io::Result<TreeInfo> {
        let mut tree = self.survey_tree(root)?;
        if tree.unsupported.is_none() {
            tree.unsupported = inspect::kernel_refusal(self, &tree.pids);
        }
        Ok(tree)
    }
    /// What the tree rooted at `root` holds, and what of it CRIU cannot dump on any kernel.
    fn survey_tree(&self, root: i32) -> io::Result<TreeInfo>;
    /// The files `pid` maps, as /proc/PID/maps names them (none when they cannot be read).
    fn mapped_files(&self, pid: i32) -> Vec<String>;
    /// The environment `pid` started with (/proc/PID/environ), as `NAME=value` entries; `None`
    /// when it cannot be read.
    fn initial_environment(&self, pid: i32) -> Option<Vec<String>>;
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
    /// The working directory of every process running as root (a CRIU works in its images
    /// directory; another user's process could stand in any directory it can reach); one
    /// that was removed, by the path it had.
    fn working_dirs(&self) -> Vec<(i32, PathBuf)>;
    /// The root of the tree CRIU (process `criu`) is restoring into a pid namespace of its
    /// own, once CRIU created it.
    fn restoring_namespace_root(&self, criu: i32) -> Option<i32>;
    /// The root of the tree a CRIU started by `launcher` is restoring into a container.
    fn restored_root_under(&self, launcher: i32) -> Option<i32>;
    /// `root` and all its descendants, depth first (the order in which CRIU walks a tree).
    fn process_tree(&self, root: i32) -> io::Result<Vec<i32>>;
    /// Every process of the trees rooted at `roots`, roots first (children forked since a
    /// tree was inspected included).
    fn trees(&self, roots: &[i32]) -> Vec<i32>;
    /// Sends `signal` to each of `pids`, ignoring those that are gone.
    fn signal(&self, pids: &[i32], signal: Signal);
    /// When process `pid` started (clock ticks since boot): with the pid, it names one process,
    /// so a pid reused by another process can be told apart.
    fn start_time(&self, pid: i32) -> Option<u64>;
    /// Whether `pid` still runs as the process that started at `started` (see
    /// [`Host::start_time`]), not a later one given its pid.
    fn still_running(&self, pid: i32, started: u64) -> bool {
        self.is_running(pid) && self.start_time(pid) == Some(started)
    }
    /// `len` bytes at `addr` of process `pid`'s memory, all of them or an error.
    fn read_memory(&self, pid: i32, addr: u64, len: usize) -> io::Result<Vec<u8>>;
    /// Which of `pids` use CUDA, as far as their mappings and descriptors tell.
    fn cuda_candidates(&self, pids: &[i32]) -> Vec<i32>;
    /// Which of `pids` hold NVIDIA device files (open or mapped).
    fn nvidia_device_holders(&self, pids: &[i32]) -> Vec<i32>;
    /// The files process `pid` holds (descriptors and mappings) that its own user may not open
    /// with the access it holds them with, leaving out those in `exempt` (device and inode);
    /// none for a process of root's (see `linux::owner_access`).
    fn files_its_user_may_not_open(&self, pid: i32, exempt: &HashSet<(u64, u64)>) -> io::Result<Vec<String>>;
    /// The sockets `pids` hold (see `sockets::survey`).
    fn sockets(&self, pids: &[i32]) -> TreeSockets;
    /// The input the TCP sockets of `pids` hold and they have not taken (see
    /// `linux::net::waiting_input`).
    fn waiting_input(&self, pids: &[i32]) -> Vec<WaitingInput>;
    /// The sockets of stasisd's own network namespace, now.
    fn socket_table(&self) -> SocketTable;
    /// The processes that hold socket `inode`, as pid and command name.
    fn socket_holders(&self, inode: u64) -> Vec<(i32, String)>;
    /// Takes the TCP sockets of `pids` out of repair mode (see `sockets::leave_repair`).
    fn leave_repair(&self, pids: &[i32], reuse_addr: &HashSet<u64>) -> (Vec<Connection>, Vec<String>);
    /// The root process of the tree in the workload cgroup at `path` (the one whose parent is
    /// outside it), if the cgroup holds one.
    fn cgroup_root(&self, path: &Path) -> Option<i32>;
    /// Removes the workload cgroup at `path` if it is empty (a busy or missing one is left).
    fn remove_empty_cgroup(&self, path: &Path);
    /// Makes (or finds) the cgroup of workload `workload` of daemon `daemon`: its path, or
    /// `None` where this host has no cgroup v2 hierarchy.
    fn create_cgroup(&self, daemon: &str, workload: &str) -> io::Result<Option<PathBuf>>;
    /// The path of the cgroup at `path` within the v2 hierarchy (`/stasis/...`), as CRIU
    /// names cgroups.
    fn cgroup_in_hierarchy(&self, path: &Path) -> Option<String>;
    /// Opens the `cgroup.procs` of the cgroup at `path`, for a child to write itself into
    /// before exec (see [`ChildSetup`]).
    fn open_cgroup_procs(&self, path: &Path) -> io::Result<File>;
    /// Spawns `cmd` with `setup` applied in the child; returns its pid (the reaper collects
    /// its exit).
    fn spawn(&self, cmd: &mut Command, setup: ChildSetup) -> io::Result<i32>;
    /// Where this release's stasis-init is, installed if it was not (see
    /// `linux::init_program`).
    fn init_program(&self) -> io::Result<PathBuf>;
    /// Installs each build of stasis-init that the images in `images` carry and this node
    /// lacks.
    fn install_init_programs(&self, images: &Path) -> io::Result<()>;
    /// A new terminal whose output goes to the log at `log`: the end a restored tree gets.
    fn terminal_to_log(&self, log: &Path) -> io::Result<OwnedFd>;
    /// stasisd's helper program `name`, installed next to it.
    fn companion_program(&self, name: &str) -> io::Result<PathBuf>;
    /// The program `name` in a directory of `PATH`, as a shell would find it.
    fn find_program(&self, name: &str) -> Option<PathBuf>;
    /// Whether this kernel gives a userfaultfd with the events CRIU's lazy restore needs
    /// (fork, remap and unmap), and if not why.
    fn userfaultfd_events(&self) -> Result<(), String>;
    /// Whether this kernel tracks soft-dirty pages (CRIU's memory tracking needs it), and if
    /// not why.
    fn soft_dirty(&self) -> Result<(), String>;
    /// The kernel's transparent-huge-page mode for anonymous memory ("always", "madvise",
    /// "never"), or `None` without huge pages (see `proc::huge_pages_mode`).
    fn huge_pages_mode(&self) -> Option<String>;
    /// Whether stasisd can copy a descriptor of another process (pidfd_getfd), and if not why.
    fn pidfd_getfd(&self) -> Result<(), String>;
    /// Whether CRIU can keep what it learns of the kernel from one run to the next (in
    /// /run/criu.kdat, kept only on a tmpfs), and if not why.
    fn criu_kernel_cache(&self) -> Result<(), String>;
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
