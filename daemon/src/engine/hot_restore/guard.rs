//! The lazy-restore guard: a `stasis-lazy-guard` process, started with the session, that from
//! CRIU's "pre-resume" notification until the tree's memory is in holds copies of the tree's
//! userfaultfds (and of those its processes fork since), so that a fault waits rather than
//! reads zeros if stasisd (which serves them) dies, and kills the tree then.
//!
//! ```text
//! stasisd ── SOCK_SEQPACKET (the guard's stdin) ── stasis-lazy-guard
//!   "h" pids, userfaultfds   ->  holds them, answers "k"
//!   "a" userfaultfds         ->  holds them too (children forked since)
//!   "r"                      ->  lets go, exits
//!   closed without an "r"    ->  kills the trees of the pids it holds for, exits
//! ```
//! It is started with the session (a plain spawn, in the background), so neither CRIU nor
//! the tree waits for it.

use std::collections::HashSet;
use std::os::fd::{AsFd, AsRawFd, BorrowedFd, OwnedFd, RawFd};
use std::process::{Command, Stdio};
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Mutex, mpsc};
use std::time::Duration;

use nix::poll::{PollFd, PollFlags, PollTimeout, poll};
use nix::sys::socket::{
    AddressFamily, ControlMessage, MsgFlags, SockFlag, SockType, recv, sendmsg, socketpair,
};
use tracing::{info, warn};

use super::control::Control;
use crate::engine::host::Host;
use crate::engine::lock;

/// The guard's executable, next to stasisd's.
const GUARD_BIN: &str = "stasis-lazy-guard";
/// How long the fault server may take to have read every userfaultfd CRIU sent, and the
/// guard to be ready and to answer.
const WAIT: Duration = Duration::from_secs(5);
/// Descriptors per message (the kernel takes at most 253).
const FDS_PER_MESSAGE: usize = 200;

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
    #[error("the guard (pid {pid}) did not take the userfaultfds")]
    NotTaken {
        pid: i32,
        #[source]
        source: std::io::Error,
    },
    #[error(
        "restored process {pid} would hold files its user may not open: {}; CRIU reopens files by \
         path as root, so a path that leads elsewhere since the checkpoint (a file replaced by a \
         link) would hand it another file: the tree was killed before it ran",
        files.join(", ")
    )]
    NotItsFiles { pid: i32, files: Vec<String> },
    #[error("cannot tell which files restored process {pid} may open")]
    FilesUnknown {
        pid: i32,
        #[source]
        source: std::io::Error,
    },
}

/// The guard of one session.
#[derive(Clone)]
pub(in crate::engine) struct FaultGuard {
    host: Arc<dyn Host>,
    control: Arc<Control>,
    tree: TreePids,
    process: Arc<Mutex<Slot>>,
    /// Whether it ever held the tree's userfaultfds (an eager restore lets it go before the
    /// tree runs).
    ran: Arc<AtomicBool>,
    /// Why the guard could not start (CRIU only logs a failed notification and goes on).
    failure: Arc<Mutex<Option<Arc<GuardError>>>>,
    /// Files stasisd hands the tree itself (device, inode): not asked about at pre-resume.
    handed: Arc<Mutex<HashSet<(u64, u64)>>>,
}

/// Where the guard process is.
enum Slot {
    Starting(mpsc::Receiver<Result<GuardProcess, GuardError>>),
    Ready(GuardProcess),
    /// Let go, or never started.
    Done,
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

/// A running `stasis-lazy-guard` and our end of its socket.
struct GuardProcess {
    pid: i32,
    channel: OwnedFd,
}

impl GuardProcess {
    fn spawn(host: &dyn Host) -> Result<GuardProcess, GuardError> {
        let spawn_err = |exe: &std::path::Path| {
            let exe = exe.to_path_buf();
            move |source| GuardError::Spawn { exe, source }
        };
        let exe = host.companion_program(GUARD_BIN).map_err(spawn_err(std::path::Path::new(GUARD_BIN)))?;
        let (ours, theirs) =
            socketpair(AddressFamily::Unix, SockType::SeqPacket, None, SockFlag::SOCK_CLOEXEC)
                .map_err(|e| spawn_err(&exe)(e.into()))?;
        // A plain spawn (posix_spawn, no copy of stasisd's page tables, however large it is):
        // the guard makes its own session, and the only descriptor it needs is its stdin.
        let child = Command::new(&exe)
            .stdin(Stdio::from(theirs))
            .stdout(Stdio::null())
            .spawn()
            .map_err(spawn_err(&exe))?;
        Ok(GuardProcess { pid: child.id() as i32, channel: ours })
    }

    /// Hands the guard `uffds` to hold for the trees of `pids` (root first); returns once it
    /// said it holds them.
    fn hold(&self, pids: &[i32], uffds: &[OwnedFd]) -> Result<(), GuardError> {
        let not_taken = |source: std::io::Error| GuardError::NotTaken { pid: self.pid, source };
        let text: Vec<String> = pids.iter().map(i32::to_string).collect();
        let mut batches = uffds.chunks(FDS_PER_MESSAGE);
        let first = batches.next().unwrap_or_default();
        send(self.channel.as_fd(), format!("h{}", text.join(",")).as_bytes(), first).map_err(not_taken)?;
        for batch in batches {
            send(self.channel.as_fd(), b"a", batch).map_err(not_taken)?;
        }
        let mut fds = [PollFd::new(self.channel.as_fd(), PollFlags::POLLIN)];
        let ready = poll(&mut fds, PollTimeout::try_from(WAIT).unwrap_or(PollTimeout::MAX))
            .map_err(|e| not_taken(e.into()))?;
        let mut answer = [0u8; 1];
        let n = match ready {
            0 => return Err(not_taken(std::io::ErrorKind::TimedOut.into())),
            _ => recv(self.channel.as_raw_fd(), &mut answer, MsgFlags::empty())
                .map_err(|e| not_taken(e.into()))?,
        };
        match (n, answer[0]) {
            (1, b'k') => Ok(()),
            _ => Err(not_taken(std::io::Error::other("it answered something else, or went away"))),
        }
    }

    /// Lets the guard go without killing anything: the tree is resident, or already killed.
    fn release(self) {
        if let Err(e) = send(self.channel.as_fd(), b"r", &[]) {
            warn!(pid = self.pid, error = %e, "cannot release the lazy-restore guard");
        }
    }
}

/// Sends one message with `fds` attached.
pub(super) fn send(channel: BorrowedFd<'_>, bytes: &[u8], fds: &[OwnedFd]) -> std::io::Result<()> {
    let raw: Vec<RawFd> = fds.iter().map(AsRawFd::as_raw_fd).collect();
    let rights = [ControlMessage::ScmRights(&raw)];
    let cmsgs = if raw.is_empty() { &[][..] } else { &rights[..] };
    let iov = [std::io::IoSlice::new(bytes)];
    sendmsg::<()>(channel.as_raw_fd(), &iov, cmsgs, MsgFlags::MSG_NOSIGNAL, None)?;
    Ok(())
}

impl FaultGuard {
    /// The guard of the tree `tree` (on `host`) whose userfaultfds the fault server that
    /// `control` shows receives; its process starts now, in the background.
    pub(super) fn new(host: Arc<dyn Host>, control: Arc<Control>, tree: TreePids) -> FaultGuard {
        let (tx, rx) = mpsc::channel();
        let spawning = host.clone();
        std::thread::spawn(move || drop(tx.send(GuardProcess::spawn(spawning.as_ref()))));
        FaultGuard {
            host,
            control,
            tree,
            process: Arc::new(Mutex::new(Slot::Starting(rx))),
            ran: Default::default(),
            failure: Default::default(),
            handed: Default::default(),
        }
    }

    /// Files (device, inode) stasisd hands the tree itself, in place of what it had open.
    pub(in crate::engine) fn hand_over(&self, files: HashSet<(u64, u64)>) {
        *lock(&self.handed) = files;
    }

    /// Refuses a tree any of whose processes would run holding a file its user may not open
    /// (one CRIU, as root, reopened by a path that may since lead elsewhere).
    fn check_files(&self, pids: &[i32]) -> Result<(), GuardError> {
        let handed = lock(&self.handed).clone();
        for &pid in pids {
            let files = self
                .host
                .files_its_user_may_not_open(pid, &handed)
                .map_err(|source| GuardError::FilesUnknown { pid, source })?;
            if !files.is_empty() {
                return Err(GuardError::NotItsFiles { pid, files });
            }
        }
        Ok(())
    }

    /// The tree's processes, root first, now that CRIU (process `criu`) has created them.
    fn pids(&self, criu: i32) -> Result<Vec<i32>, GuardError> {
        match &self.tree {
            TreePids::Recorded(pids) => Ok(pids.clone()),
            TreePids::InNamespace(roots) => {
                let root =
                    self.host.restoring_namespace_root(criu).ok_or(GuardError::NoNamespaceRoot(criu))?;
                *lock(roots) = vec![root];
                self.host.process_tree(root).map_err(GuardError::ListPids)
            }
            TreePids::InContainer(roots) => {
                let root = self.host.restored_root_under(criu).ok_or(GuardError::NoNamespaceRoot(criu))?;
                *lock(roots) = vec![root];
                self.host.process_tree(root).map_err(GuardError::ListPids)
            }
        }
    }

    /// Has the guard hold the tree's userfaultfds, at CRIU's (process `criu`) pre-resume. A
    /// failure is recorded: the restore then kills the tree rather than let it run unguarded.
    pub(in crate::engine) fn start(&self, criu: i32) -> Result<(), Arc<GuardError>> {
        let result = self
            .pids(criu)
            .and_then(|pids| self.check_files(&pids).and_then(|()| self.try_start(&pids)))
            .map_err(Arc::new);
        if let Err(reason) = &result {
            *lock(&self.failure) = Some(reason.clone());
        }
        result
    }

    fn try_start(&self, tree: &[i32]) -> Result<(), GuardError> {
        let copies = self.control.uffd_copies(WAIT).map_err(GuardError::CopyFds)?;
        let copies = copies.filter(|c| !c.is_empty()).ok_or(GuardError::NoUserfaultfd)?;
        let mut slot = lock(&self.process);
        if let Slot::Starting(rx) = &*slot {
            let spawned = rx
                .recv_timeout(WAIT)
                .map_err(|e| GuardError::Spawn { exe: GUARD_BIN.into(), source: std::io::Error::other(e) })
                .and_then(|r| r);
            match spawned {
                Ok(process) => *slot = Slot::Ready(process),
                Err(e) => {
                    *slot = Slot::Done;
                    return Err(e);
                }
            }
        }
        let Slot::Ready(process) = &*slot else { return Err(GuardError::NoPreResume) };
        process.hold(tree, &copies)?;
        let channel = process.channel.try_clone().map_err(GuardError::CopyFds)?;
        self.control.set_guard(Some(channel));
        info!(
            guard = process.pid,
            userfaultfds = copies.len(),
            "lazy-restore guard holds the tree's userfaultfds"
        );
        self.ran.store(true, Ordering::SeqCst);
        Ok(())
    }

    /// Whether the guard holds the tree's userfaultfds now.
    pub(super) fn holding(&self) -> bool {
        self.ran.load(Ordering::SeqCst) && matches!(*lock(&self.process), Slot::Ready(_))
    }

    /// Lets the guard go (started or not) without killing anything: the tree is resident,
    /// already killed, or was never let run.
    pub(super) fn release(&self) {
        self.control.set_guard(None);
        let slot = std::mem::replace(&mut *lock(&self.process), Slot::Done);
        let process = match slot {
            Slot::Ready(process) => Some(process),
            Slot::Starting(rx) => rx.recv_timeout(WAIT).ok().and_then(Result::ok),
            Slot::Done => None,
        };
        process.into_iter().for_each(GuardProcess::release);
    }

    /// Why the guard could not hold the tree's userfaultfds, if it tried and failed.
    pub(in crate::engine) fn failed(&self) -> Option<Arc<GuardError>> {
        lock(&self.failure).clone()
    }

    /// Why the guard did not hold the tree's userfaultfds before it ran, if it did not.
    pub(in crate::engine) fn not_started(&self) -> Option<Arc<GuardError>> {
        if self.ran.load(Ordering::SeqCst) {
            return None;
        }
        Some(lock(&self.failure).clone().unwrap_or_else(|| Arc::new(GuardError::NoPreResume)))
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::engine::host::fake::FakeHost;

    /// A pid no process can have (above Linux's largest pid_max).
    const CRIU: i32 = 4_194_450;

    #[test]
    fn a_guard_that_finds_no_restored_tree_at_pre_resume_fails_and_says_why() {
        let roots = super::super::Roots::default();
        let control = Arc::new(Control::new().unwrap());
        let guard =
            FaultGuard::new(Arc::new(FakeHost::default()), control, TreePids::InNamespace(roots.clone()));
        let err = guard.start(CRIU).unwrap_err();
        assert!(matches!(*err, GuardError::NoNamespaceRoot(CRIU)), "{err}");
        // The restore asks before letting the tree run: it is told why, and kills the tree.
        let why = guard.not_started().expect("not started");
        assert!(matches!(*why, GuardError::NoNamespaceRoot(CRIU)), "{why}");
        assert!(matches!(guard.failed().as_deref(), Some(GuardError::NoNamespaceRoot(CRIU))));
        assert!(lock(&roots).is_empty(), "no root to kill was made up");
        assert!(!guard.holding());
        guard.release();
    }

    #[test]
    fn a_tree_holding_a_file_its_user_may_not_open_is_refused_before_the_guard_holds_it() {
        let host = FakeHost::default();
        host.foreign_files.lock().unwrap().insert(CRIU + 2, vec!["fd 5 (/etc/shadow)".into()]);
        let control = Arc::new(Control::new().unwrap());
        let guard = FaultGuard::new(Arc::new(host), control, TreePids::Recorded(vec![CRIU + 1, CRIU + 2]));
        let err = guard.start(CRIU).unwrap_err();
        assert!(
            matches!(&*err, GuardError::NotItsFiles { pid, files } if *pid == CRIU + 2 && files.len() == 1)
        );
        assert!(err.to_string().contains("/etc/shadow") && err.to_string().contains("killed"), "{err}");
        let why = guard.not_started().expect("refused before it held anything");
        assert!(matches!(*why, GuardError::NotItsFiles { .. }), "{why}");
        assert!(!guard.holding());
        guard.release();
    }
}
