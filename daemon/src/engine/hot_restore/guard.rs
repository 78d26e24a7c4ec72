//! The lazy-restore guard: from CRIU's "pre-resume" notification until the tree's memory is in,
//! a `stasis-lazy-guard` process holds copies of the tree's userfaultfds, so that a fault waits
//! rather than reads zeros if stasisd (which serves them) dies, and kills the tree then.

use std::io::Write;
use std::os::fd::AsRawFd;
use std::process::{Command, Stdio};
use std::sync::Arc;
use std::time::Duration;

use tracing::{info, warn};

use super::server::Control;
use crate::engine::lock;
use crate::linux::proc;
use crate::linux::sys::{ChildSetup, spawn};

/// The guard's executable, next to stasisd's.
const GUARD_BIN: &str = "stasis-lazy-guard";

/// Why the lazy-restore guard could not start.
#[derive(Debug, thiserror::Error)]
pub enum GuardError {
    #[error("cannot list the restored tree's processes")]
    ListPids(#[source] std::io::Error),
    #[error("cannot copy the tree's userfaultfds")]
    CopyFds(#[source] std::io::Error),
    #[error("CRIU had not handed over every userfaultfd of the tree at pre-resume")]
    NoUserfaultfd,
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

/// Started at CRIU's "pre-resume" notification (every task's userfaultfd is with the fault
/// server and the tree does not run yet): a `stasis-lazy-guard` process holding copies of
/// those userfaultfds, so that a fault waits rather than reads zeros if stasisd dies, and
/// that kills the tree then.
#[derive(Clone)]
pub(in crate::engine) struct FaultGuard {
    control: Arc<Control>,
    tree: TreePids,
    started: Arc<std::sync::Mutex<Option<GuardProcess>>>,
    /// Whether it ever started (an eager restore lets it go before the tree runs).
    ran: Arc<std::sync::atomic::AtomicBool>,
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

/// How long the fault server may take to have read every userfaultfd CRIU sent.
const UFFDS_WAIT: Duration = Duration::from_secs(5);

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
    /// A guard, not started yet, for the tree `tree` whose userfaultfds the fault server that
    /// `control` shows receives.
    pub(super) fn new(control: Arc<Control>, tree: TreePids) -> FaultGuard {
        FaultGuard {
            control,
            tree,
            started: Default::default(),
            ran: Default::default(),
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
                proc::process_tree(root).map_err(GuardError::ListPids)
            }
            TreePids::InContainer(roots) => {
                let root = proc::restored_root_under(criu).ok_or(GuardError::NoNamespaceRoot(criu))?;
                *lock(roots) = vec![root];
                proc::process_tree(root).map_err(GuardError::ListPids)
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
        if self.ran.load(std::sync::atomic::Ordering::SeqCst) {
            return None;
        }
        Some(lock(&self.failure).clone().unwrap_or_else(|| Arc::new(GuardError::NoPreResume)))
    }

    fn try_start(&self, tree: &[i32]) -> Result<(), GuardError> {
        let copies = self.control.uffd_copies(UFFDS_WAIT).map_err(GuardError::CopyFds)?;
        let copies = copies.filter(|c| !c.is_empty()).ok_or(GuardError::NoUserfaultfd)?;
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
        self.ran.store(true, std::sync::atomic::Ordering::SeqCst);
        Ok(())
    }

    pub(super) fn take(&self) -> Option<GuardProcess> {
        lock(&self.started).take()
    }
}
