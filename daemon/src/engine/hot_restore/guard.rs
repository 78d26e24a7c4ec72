//! The lazy-restore guard: from CRIU's "pre-resume" notification until the tree's memory is in,
//! a `stasis-lazy-guard` process holds copies of the tree's userfaultfds, so that a fault waits
//! rather than reads zeros if CRIU's lazy-pages daemon dies, and kills the tree if stasisd dies.

use std::io::Write;
use std::os::fd::{AsRawFd, OwnedFd};
use std::process::{Command, Stdio};
use std::sync::Arc;
use std::time::{Duration, Instant};

use tracing::{info, warn};

use crate::engine::lock;
use crate::linux::proc;
use crate::linux::reaper::{ExitKind, Reaper};
use crate::linux::sys::{ChildSetup, copy_fd_of, spawn};

/// The guard's executable, next to stasisd's.
const GUARD_BIN: &str = "stasis-lazy-guard";

/// Why the lazy-restore guard could not start.
#[derive(Debug, thiserror::Error)]
pub enum GuardError {
    #[error("cannot list the lazy-pages daemon's descriptors")]
    ListFds(#[source] std::io::Error),
    #[error("cannot copy the lazy-pages daemon's userfaultfds")]
    CopyFds(#[source] std::io::Error),
    #[error("the lazy-pages daemon holds no userfaultfd at pre-resume")]
    NoUserfaultfd,
    #[error("the lazy-pages daemon ended ({0}) before the tree ran")]
    DaemonEnded(ExitKind),
    #[error("CRIU did not announce pre-resume")]
    NoPreResume,
    #[error("at pre-resume, CRIU (pid {0}) holds no restored tree")]
    NoNamespaceRoot(i32),
    #[error("cannot start {exe}")]
    Spawn {
        exe: std::path::PathBuf,
        #[source]
        source: std::io::Error,
    },
}

/// Started at CRIU's "pre-resume" notification (every task's userfaultfd is with the
/// lazy-pages daemon and the tree does not run yet): a `stasis-lazy-guard` process holding
/// copies of those userfaultfds, so that a fault waits rather than reads zeros if the daemon
/// dies, and that kills the tree if stasisd dies before the memory is in.
#[derive(Clone)]
pub(in crate::engine) struct FaultGuard {
    daemon: i32,
    reaper: Reaper,
    tree: TreePids,
    /// How many of the tree's tasks have memory restored lazily: CRIU gives each of those,
    /// and only those, a userfaultfd.
    lazy_tasks: usize,
    started: Arc<std::sync::Mutex<Option<GuardProcess>>>,
    /// Why the guard could not start (CRIU only logs a failed notification and goes on).
    failure: Arc<std::sync::Mutex<Option<Arc<GuardError>>>>,
}

/// The restored tree's processes, as the guard learns them.
#[derive(Clone)]
pub(in crate::engine) enum TreePids {
    /// As recorded (root first): the restore gives them back.
    Recorded(Vec<i32>),
    /// A tree with its own pid namespace, numbered anew outside it: found at pre-resume as
    /// the namespace CRIU created, whose root then goes into these roots (for killing).
    InNamespace(super::Roots),
    /// A tree restored into a container (by a CRIU that entered it): found at pre-resume as
    /// the process CRIU created and holds, whose root then goes into these roots.
    InContainer(super::Roots),
}

/// How long the restore's userfaultfds may take to reach the lazy-pages daemon.
const UFFDS_WAIT: Duration = Duration::from_secs(5);
/// How long an unchanged, non-zero count of them is waited on before it is taken as all.
const UFFDS_SETTLED: Duration = Duration::from_millis(200);

/// A running `stasis-lazy-guard`; writing a byte to `control` (or dropping it after stasisd
/// died) ends it.
pub(super) struct GuardProcess {
    pid: i32,
    control: std::fs::File,
}

impl GuardProcess {
    /// Lets the guard go without killing anything: the tree is resident, or already killed.
    pub(super) fn release(mut self) {
        if let Err(e) = self.control.write_all(b"r") {
            warn!(pid = self.pid, error = %e, "cannot release the lazy-restore guard");
        }
    }
}

impl FaultGuard {
    /// A guard, not started yet, for the tree `pids` (root first) that the lazy-pages daemon
    /// `daemon` serves, `lazy_tasks` of whose tasks have memory restored lazily.
    pub(super) fn new(daemon: i32, reaper: Reaper, tree: TreePids, lazy_tasks: usize) -> FaultGuard {
        FaultGuard {
            daemon,
            reaper,
            tree,
            lazy_tasks,
            started: Default::default(),
            failure: Default::default(),
        }
    }

    /// The tree's processes, root first, now that CRIU (process `criu`) has created them.
    fn pids(&self, criu: i32) -> Result<Vec<i32>, GuardError> {
        match &self.tree {
            TreePids::Recorded(pids) => Ok(pids.clone()),
            TreePids::InNamespace(roots) => {
                let root = proc::restoring_namespace_root(criu).ok_or(GuardError::NoNamespaceRoot(criu))?;
                *lock(roots) = vec![root];
                proc::process_tree(root).map_err(GuardError::ListFds)
            }
            TreePids::InContainer(roots) => {
                let root = proc::restored_root_under(criu).ok_or(GuardError::NoNamespaceRoot(criu))?;
                *lock(roots) = vec![root];
                proc::process_tree(root).map_err(GuardError::ListFds)
            }
        }
    }

    /// Starts the guard, at CRIU's (process `criu`) pre-resume. A failure is recorded: the
    /// restore then kills the tree rather than let it run unguarded.
    pub(in crate::engine) fn start(&self, criu: i32) -> Result<(), Arc<GuardError>> {
        let result = self.pids(criu).and_then(|pids| self.try_start(&pids)).map_err(Arc::new);
        if let Err(reason) = &result {
            *lock(&self.failure) = Some(reason.clone());
        }
        result
    }

    /// Why the guard is not running, if it is not and should be.
    pub(in crate::engine) fn not_started(&self) -> Option<Arc<GuardError>> {
        if lock(&self.started).is_some() {
            return None;
        }
        if let Some(failure) = lock(&self.failure).clone() {
            return Some(failure);
        }
        // Not needed when the daemon finished before the tree ran.
        match self.reaper.peek_exit(self.daemon) {
            Some(ExitKind::Exited(0)) => None,
            _ => Some(Arc::new(GuardError::NoPreResume)),
        }
    }

    /// The daemon's userfaultfds: one per live task with lazy memory, some possibly still in
    /// transit from the restore, so it waits a little for all of them. The daemon closes the
    /// one of a task all of whose memory is in (a small task's, often before the others
    /// arrive), so a count that has held still for a moment is taken as complete too.
    fn daemon_uffds(&self, tasks: usize) -> Result<Vec<i32>, GuardError> {
        let deadline = Instant::now() + UFFDS_WAIT;
        let mut seen = (usize::MAX, Instant::now());
        loop {
            let fds = proc::fd_targets(self.daemon).map_err(GuardError::ListFds)?;
            let uffds: Vec<i32> = fds
                .into_iter()
                .filter(|(_, target)| target.as_os_str() == "anon_inode:[userfaultfd]")
                .map(|(fd, _)| fd)
                .collect();
            if uffds.len() != seen.0 {
                seen = (uffds.len(), Instant::now());
            }
            let settled = !uffds.is_empty() && seen.1.elapsed() >= UFFDS_SETTLED;
            if uffds.len() >= tasks || settled || Instant::now() >= deadline {
                if uffds.len() < tasks {
                    // Zombies of the tree get none; a missing one is a task left unguarded.
                    warn!(found = uffds.len(), tasks, "fewer userfaultfds than tasks");
                }
                return Ok(uffds);
            }
            std::thread::sleep(Duration::from_millis(5));
        }
    }

    /// Whether the daemon has already exited with success (within a short wait for its exit to
    /// be collected); an error when it ended otherwise.
    fn daemon_done(&self) -> Result<bool, GuardError> {
        let deadline = Instant::now() + Duration::from_secs(1);
        loop {
            match self.reaper.peek_exit(self.daemon) {
                Some(ExitKind::Exited(0)) => return Ok(true),
                Some(exit) => return Err(GuardError::DaemonEnded(exit)),
                None if Instant::now() >= deadline => return Ok(false),
                None => std::thread::sleep(Duration::from_millis(10)),
            }
        }
    }

    /// Copies of the daemon's userfaultfds.
    fn copy_uffds(&self, tasks: usize) -> Result<Vec<OwnedFd>, GuardError> {
        let mut copies = Vec::new();
        for fd in self.daemon_uffds(tasks)? {
            match copy_fd_of(self.daemon, fd) {
                Ok(copy) => copies.push(copy),
                // Closed since it was listed: the daemon is done with that task (all its
                // memory is in), so there is nothing of it left to guard.
                Err(e) if e.raw_os_error() == Some(libc::EBADF) => {}
                Err(e) => return Err(GuardError::CopyFds(e)),
            }
        }
        if copies.is_empty() {
            return Err(GuardError::NoUserfaultfd);
        }
        Ok(copies)
    }

    fn try_start(&self, tree: &[i32]) -> Result<(), GuardError> {
        let copies = match self.copy_uffds(self.lazy_tasks.min(tree.len())) {
            Ok(copies) => copies,
            // The daemon may have brought every page in and exited before the tree runs (its
            // background transfer starts once CRIU says the restore is done): nothing to guard.
            Err(reason) => return if self.daemon_done()? { Ok(()) } else { Err(reason) },
        };
        let spawn_err = |exe: &std::path::Path| {
            let exe = exe.to_path_buf();
            move |source| GuardError::Spawn { exe, source }
        };
        let exe =
            crate::linux::companion_program(GUARD_BIN).map_err(spawn_err(std::path::Path::new(GUARD_BIN)))?;
        let (control_r, control_w) =
            nix::unistd::pipe2(nix::fcntl::OFlag::O_CLOEXEC).map_err(|e| spawn_err(&exe)(e.into()))?;
        let pids: Vec<String> = tree.iter().map(i32::to_string).collect();
        let mut cmd = Command::new(&exe);
        cmd.args(["--root", &pids[0], "--pids", &pids.join(",")])
            .stdin(Stdio::from(control_r))
            .stdout(Stdio::null());
        let setup = ChildSetup {
            new_session: true,
            keep_fds: copies.iter().map(AsRawFd::as_raw_fd).collect(),
            ..Default::default()
        };
        let child = spawn(&mut cmd, setup).map_err(spawn_err(&exe))?;
        info!(
            guard = child.id(),
            userfaultfds = copies.len(),
            "lazy-restore guard holds the tree's userfaultfds"
        );
        let guard = GuardProcess { pid: child.id() as i32, control: std::fs::File::from(control_w) };
        *lock(&self.started) = Some(guard);
        Ok(())
    }

    pub(super) fn take(&self) -> Option<GuardProcess> {
        lock(&self.started).take()
    }
}
