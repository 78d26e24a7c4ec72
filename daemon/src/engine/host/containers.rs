//! What Kubernetes containers ask of the kernel (see `engine/pods/`): which pid namespace a
//! process is in, a container's init and its children, readying a container for a CRIU that
//! enters it, reserving the pids a restored tree needs there, its init's descriptors, and the
//! CUDA driver inside it (`container_cuda.rs`).
//! [`super::LinuxHost`] does it through /proc, pidfds and nsenter (`linux/container.rs`).

use std::io;
use std::os::fd::OwnedFd;
use std::path::PathBuf;
use std::sync::Arc;

use async_trait::async_trait;

use crate::cuda::GpuCheckpointer;
use crate::linux::reaper::Reaper;

/// The kernel's containers.
#[async_trait]
pub trait Containers: Send + Sync {
    /// Whether `pid` is the init (pid 1) of a pid namespace below stasisd's.
    fn is_namespace_init(&self, pid: i32) -> bool;
    /// The pid namespace of `pid` (its inode): the same for two processes of one container.
    fn pid_namespace(&self, pid: i32) -> io::Result<u64>;
    /// The children of `pid` (none where they cannot be read).
    fn children(&self, pid: i32) -> Vec<i32>;
    /// The threads of `pid` (none where it is gone).
    fn threads(&self, pid: i32) -> Vec<i32>;
    /// What descriptor `fd` of `pid` is, as CRIU names it (`pipe:[123]`, `/dev/null`).
    fn fd_target(&self, pid: i32, fd: i32) -> io::Result<String>;
    /// A copy of descriptor `fd` of `pid`.
    fn copy_fd_of(&self, pid: i32, fd: i32) -> io::Result<OwnedFd>;
    /// Makes `/tmp` in the root of `pid`'s mount namespace if it has none: a CRIU entering
    /// the container needs one.
    fn ensure_tmp(&self, pid: i32) -> io::Result<()>;
    /// The `cgroup.procs` files of the cgroups `pid` is in, in every hierarchy: what a CRIU
    /// joins to restore into its container.
    fn cgroup_procs_files(&self, pid: i32) -> io::Result<Vec<PathBuf>>;
    /// Has the pid namespace whose init is `init` hand out pids above `highest` from now on,
    /// and waits (a while) until none of `needed` is in use there; commands run through
    /// `reaper`.
    async fn reserve_pids(&self, reaper: &Reaper, init: i32, highest: i32, needed: &[i32]) -> io::Result<()>;
    /// The CUDA driver as the processes of the container whose init is `init` see it: its
    /// calls take this host's pids and are made inside the container (running helpers
    /// through `reaper`). Call only where stasisd has a driver of its own.
    fn cuda_in(&self, reaper: &Reaper, init: i32) -> Arc<dyn GpuCheckpointer>;
}
