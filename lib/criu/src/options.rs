//! What stasis asks of CRIU, and its translation into CRIU's RPC options.

use std::os::fd::{AsRawFd, OwnedFd, RawFd};
use std::path::{Path, PathBuf};

use nix::fcntl::{OFlag, open};
use nix::sys::stat::Mode;
use stasis_proto::criu::{CgroupMode, CgroupRoot, InheritFd, NetworkLockMethod, Options, PageServerInfo};

use super::{CriuError, LOG_FILE, NetworkLock};

/// CRIU log level 4: debug. Its tail is what makes a failure explainable.
const LOG_LEVEL: i32 = 4;

/// Options that depend on what the tree holds; found at dump time, repeated at restore.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct TreeOptions {
    /// The tree's session or process group leader is outside it (a job of a shell).
    pub shell_job: bool,
    /// The tree holds established TCP connections.
    pub tcp_established: bool,
    /// The tree holds Unix sockets that may have peers outside it.
    pub ext_unix_sk: bool,
    /// The tree holds file locks.
    pub file_locks: bool,
    /// The tree holds deleted files open or mapped (e.g. POSIX semaphores in /dev/shm); CRIU
    /// keeps them by linking them back under a temporary name.
    pub link_remap: bool,
    /// External resources (CRIU `--external` keys), e.g. a terminal `tty[rdev:dev]`.
    pub external: Vec<String>,
    /// How established TCP connections are locked; a restore unlocks them the same way.
    pub network_lock: Option<NetworkLock>,
}

impl TreeOptions {
    /// Human-readable list of the options in effect, for `stasis show`.
    pub fn describe(&self) -> Vec<String> {
        let flags = [
            (self.shell_job, "shell-job"),
            (self.tcp_established, "tcp-established"),
            (self.ext_unix_sk, "ext-unix-sk"),
            (self.file_locks, "file-locks"),
            (self.link_remap, "link-remap"),
        ];
        let mut out: Vec<String> = flags.iter().filter(|(on, _)| *on).map(|(_, n)| n.to_string()).collect();
        out.extend(self.external.iter().map(|e| format!("external {e}")));
        if self.tcp_established {
            out.extend(self.network_lock.map(|l| format!("network-lock {}", l.name())));
        }
        out
    }

    fn apply(&self, opts: &mut Options) {
        opts.shell_job = Some(self.shell_job);
        opts.tcp_established = Some(self.tcp_established);
        opts.ext_unix_sk = Some(self.ext_unix_sk);
        opts.file_locks = Some(self.file_locks);
        opts.link_remap = Some(self.link_remap);
        opts.network_lock = self.network_lock.map(|lock| match lock {
            NetworkLock::Nftables => NetworkLockMethod::Nftables as i32,
            NetworkLock::Iptables => NetworkLockMethod::Iptables as i32,
        });
    }
}

/// Where CRIU runs when the tree lives in a container: inside every namespace of the
/// container's init `pid` (a host pid), so that the tree's mounts, pids and files are CRIU's
/// own; from the pod bundle the container mounts at `bundle` (see `scripts/pod-bundle.sh`);
/// in the cgroups whose `cgroup.procs` files are `cgroups`, which a restored tree inherits.
///
/// CRIU starts with the bundle as its root directory, so that its loader and libraries are the
/// bundle's and nothing of the image (its `/etc/ld.so.preload`, its libraries) runs in it; the
/// bundle's `libstasis_enter_root.so`, preloaded, then moves it into the container's root.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct Enter {
    pub pid: i32,
    pub bundle: PathBuf,
    pub cgroups: Vec<PathBuf>,
}

/// A dump request.
#[derive(Debug, Clone)]
pub struct DumpSpec {
    /// The tree's root, as CRIU sees it (inside the container's pid namespace if `enter`).
    pub pid: i32,
    pub images_dir: PathBuf,
    pub tree: TreeOptions,
    /// Let the tree run on after the dump.
    pub leave_running: bool,
    /// Leave the tree stopped (SIGSTOP) after the dump instead of killing it.
    pub leave_stopped: bool,
    /// A connected stream socket for CRIU's page-server traffic, if pages go to stasisd.
    pub page_server_fd: Option<RawFd>,
    /// Run CRIU inside the tree's container.
    pub enter: Option<Enter>,
    /// Track dirty pages (the kernel's soft-dirty bits): CRIU clears the tree's bits once its
    /// pages are read, so that the next dump can tell what was written since.
    pub track_mem: bool,
    /// With `track_mem`: the directory (relative to the images directory) of the previous
    /// tracked dump of this tree, holding its `inventory.img`; CRIU then sends pages not
    /// written since as "in parent" (see `pageserver`).
    pub parent: Option<PathBuf>,
}

impl DumpSpec {
    pub(super) fn to_options(&self, dir_fd: RawFd) -> Options {
        let mut opts = base_options(dir_fd, self.enter.is_some());
        opts.pid = Some(self.pid);
        opts.leave_running = Some(self.leave_running);
        opts.leave_stopped = Some(self.leave_stopped);
        opts.notify_scripts = Some(true);
        // A connection a listener has not accepted yet is dropped (its client sees a reset and
        // may retry) rather than failing the whole dump.
        opts.tcp_skip_in_flight = Some(true);
        opts.external = self.tree.external.clone();
        self.tree.apply(&mut opts);
        if let Some(fd) = self.page_server_fd {
            opts.ps = Some(PageServerInfo { fd: Some(fd), ..Default::default() });
        }
        if self.track_mem {
            opts.track_mem = Some(true);
            opts.parent_img = self.parent.as_ref().map(|p| p.to_string_lossy().into_owned());
        }
        opts
    }
}

/// A restore request.
#[derive(Debug)]
pub struct RestoreSpec {
    pub images_dir: PathBuf,
    pub tree: TreeOptions,
    /// Descriptors handed to the restored tree in place of external resources.
    pub inherit_fds: Vec<(String, OwnedFd)>,
    /// Leave the pages marked lazy to a running `criu lazy-pages` daemon on the same images.
    pub lazy_pages: bool,
    /// Restore established TCP connections closed: the tree finds them reset.
    pub tcp_close: bool,
    /// Move the tree from its root's cgroup at dump time into this one (of the v2
    /// hierarchy, e.g. `/stasis/<node>/<workload>`).
    pub cgroup: Option<String>,
    /// Run CRIU inside the container the tree is restored into; the tree is then left to the
    /// container's init (CRIU's reaper there), in CRIU's cgroups.
    pub enter: Option<Enter>,
    /// Holds the pid of the CRIU process (its launcher's, in a container) while it runs, 0
    /// before and after: whoever must kill the tree while CRIU still holds it kills CRIU too.
    pub running: Option<RunningCriu>,
}

/// The pid of a CRIU at work, 0 when none is (see [`RestoreSpec::running`]).
pub type RunningCriu = std::sync::Arc<std::sync::atomic::AtomicI32>;

impl RestoreSpec {
    pub(super) fn to_options(&self, dir_fd: RawFd) -> Options {
        let mut opts = base_options(dir_fd, self.enter.is_some());
        // The restored root becomes our child (a sibling of CRIU), so stasisd reaps it; in a
        // container it becomes the container init's once CRIU exits.
        opts.rst_sibling = Some(self.enter.is_none());
        if self.enter.is_some() {
            opts.manage_cgroups = Some(true);
            opts.manage_cgroups_mode = Some(CgroupMode::CgIgnore as i32);
        }
        opts.notify_scripts = Some(true);
        opts.lazy_pages = Some(self.lazy_pages);
        self.tree.apply(&mut opts);
        opts.tcp_close = Some(self.tcp_close);
        // "" names the v2 hierarchy; v1 controllers keep the cgroups the images name.
        opts.cgroup_root = self
            .cgroup
            .iter()
            .map(|path| CgroupRoot { ctrl: Some(String::new()), path: path.clone() })
            .collect();
        opts.inherit_fd = self
            .inherit_fds
            .iter()
            .map(|(key, fd)| InheritFd { key: key.clone(), fd: fd.as_raw_fd() })
            .collect();
        opts
    }
}

/// Options every request carries: where images and the log go. A CRIU inside a container
/// cannot see stasisd's `/proc/<pid>/fd`, so it gets the descriptor itself (kept across exec)
/// and names it through its own.
pub(super) fn base_options(dir_fd: RawFd, entered: bool) -> Options {
    let (images_dir_fd, images_dir) = match entered {
        false => (Some(dir_fd), None),
        true => (None, Some(format!("/proc/self/fd/{dir_fd}"))),
    };
    Options {
        images_dir_fd,
        images_dir,
        log_level: Some(LOG_LEVEL),
        log_file: Some(LOG_FILE.into()),
        ..Default::default()
    }
}

/// Opens a directory for CRIU, which reaches it through `/proc/<our pid>/fd/<fd>`.
pub(super) fn open_dir(path: &Path) -> Result<OwnedFd, CriuError> {
    open(path, OFlag::O_DIRECTORY | OFlag::O_RDONLY | OFlag::O_CLOEXEC, Mode::empty())
        .map_err(|source| CriuError::ImagesDir { path: path.to_path_buf(), source })
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn dump_options_carry_tree_options_and_page_server() {
        let spec = DumpSpec {
            pid: 42,
            images_dir: "/tmp".into(),
            tree: TreeOptions {
                shell_job: true,
                file_locks: true,
                tcp_established: true,
                network_lock: Some(NetworkLock::Nftables),
                ..Default::default()
            },
            leave_running: false,
            leave_stopped: true,
            page_server_fd: Some(9),
            enter: None,
            track_mem: false,
            parent: None,
        };
        let o = spec.to_options(7);
        assert_eq!((o.track_mem, o.parent_img.as_deref()), (None, None));
        assert_eq!(o.images_dir_fd, Some(7));
        assert_eq!(o.pid, Some(42));
        assert_eq!((o.shell_job, o.file_locks, o.tcp_established), (Some(true), Some(true), Some(true)));
        assert_eq!(o.leave_stopped, Some(true));
        assert_eq!(o.ps.and_then(|p| p.fd), Some(9));
        assert_eq!(o.network_lock, Some(NetworkLockMethod::Nftables as i32));
        assert_eq!(o.tcp_skip_in_flight, Some(true));
        assert_eq!(
            spec.tree.describe(),
            vec!["shell-job", "tcp-established", "file-locks", "network-lock nftables"]
        );
        let tracked = DumpSpec { track_mem: true, parent: Some("previous".into()), ..spec }.to_options(7);
        assert_eq!((tracked.track_mem, tracked.parent_img.as_deref()), (Some(true), Some("previous")));
    }
}
