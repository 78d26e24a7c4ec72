//! What a session's owner sees of its fault server while it runs, and how it stops it: the
//! bytes put in place, copies of the tree's userfaultfds (for the guard), whether CRIU said
//! the restore finished, whether every page is in place, and whether the server let go of
//! its userfaultfds. Shared between the server's thread and the restore's job.

use std::os::fd::{AsFd, OwnedFd};
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::{Condvar, Mutex};
use std::time::{Duration, Instant};

use nix::sys::eventfd::{EfdFlags, EventFd};
use tracing::warn;

use crate::engine::lock;

/// What the session's owner sees of the server while it runs, and how it closes it.
pub(in crate::engine) struct Control {
    pub(super) stopped: AtomicBool,
    /// Wakes the server's poll (to stop or close).
    pub(super) wake: EventFd,
    pub(super) placed: AtomicU64,
    /// Copies of the tree's userfaultfds, for the guard.
    pub(super) uffds: Mutex<Vec<OwnedFd>>,
    /// The guard's socket once it holds them: a forked child's goes there too.
    guard: Mutex<Option<OwnedFd>>,
    state: Mutex<Phase>,
    changed: Condvar,
}

/// Where a session is.
#[derive(Debug, Clone, Default)]
pub(super) struct Phase {
    /// CRIU said the restore finished: every userfaultfd is in `uffds`.
    pub finished: bool,
    /// Every page in place, or why not, and when.
    pub outcome: Option<(Result<(), String>, Instant)>,
    /// The server let go of its userfaultfds.
    pub closed: bool,
}

impl Control {
    pub fn new() -> std::io::Result<Control> {
        Ok(Control {
            stopped: AtomicBool::new(false),
            wake: EventFd::from_value_and_flags(0, EfdFlags::EFD_CLOEXEC | EfdFlags::EFD_NONBLOCK)?,
            placed: AtomicU64::new(0),
            uffds: Mutex::new(Vec::new()),
            guard: Mutex::new(None),
            state: Mutex::new(Phase::default()),
            changed: Condvar::new(),
        })
    }

    /// Stops the server: before every page is in place that is a failure
    /// ([`FaultServerError::Stopped`]), after it the server closes.
    pub fn stop(&self) {
        self.stopped.store(true, Ordering::SeqCst);
        let _ = self.wake.write(1);
    }

    /// Bytes of memory put in place so far.
    pub fn placed(&self) -> u64 {
        self.placed.load(Ordering::Relaxed)
    }

    /// Copies of every userfaultfd CRIU handed over, once it said the restore finished
    /// (waiting at most `wait` for that); `None` if it did not.
    pub fn uffd_copies(&self, wait: Duration) -> std::io::Result<Option<Vec<OwnedFd>>> {
        let finished =
            self.wait_for(Some(wait), |p| p.finished || p.outcome.is_some()).is_some_and(|p| p.finished);
        if !finished {
            return Ok(None);
        }
        lock(&self.uffds).iter().map(OwnedFd::try_clone).collect::<Result<_, _>>().map(Some)
    }

    /// Lets go of the copies of the tree's userfaultfds (the server is done with them).
    pub(super) fn forget_uffds(&self) {
        lock(&self.uffds).clear();
    }

    /// The guard's socket while it holds the tree's userfaultfds (`None`: let go).
    pub fn set_guard(&self, channel: Option<OwnedFd>) {
        *lock(&self.guard) = channel;
    }

    /// A userfaultfd received since the guard started (a forked child's): to the guard too.
    pub(super) fn guard_also(&self, uffd: OwnedFd) {
        if let Some(channel) = &*lock(&self.guard)
            && let Err(e) = super::guard::send(channel.as_fd(), b"a", &[uffd])
        {
            warn!(error = %e, "cannot hand a forked child's userfaultfd to the lazy-restore guard");
        }
    }

    /// How the session ended if it did (every page in place, or why not), and when.
    pub fn outcome(&self) -> Option<(Result<(), String>, Instant)> {
        lock(&self.state).outcome.clone()
    }

    /// Waits until every page is in place; the reason when the session failed instead.
    pub fn wait_resident(&self) -> Result<(), String> {
        let phase = self.wait_for(None, |p| p.outcome.is_some());
        phase.and_then(|p| p.outcome).map_or_else(|| Err("the session ended".into()), |(o, _)| o)
    }

    /// Closes the server of a resident tree and waits until its userfaultfds are closed.
    pub fn close(&self) {
        self.stop();
        self.wait_for(None, |p| p.closed);
    }

    /// The phase once `done` holds of it, waiting at most `wait` (`None` when it did not).
    fn wait_for(&self, wait: Option<Duration>, done: impl Fn(&Phase) -> bool) -> Option<Phase> {
        let deadline = wait.map(|w| Instant::now() + w);
        let mut state = lock(&self.state);
        while !done(&state) {
            state = match deadline {
                None => self.changed.wait(state).unwrap_or_else(|p| p.into_inner()),
                Some(deadline) => {
                    let left = deadline.saturating_duration_since(Instant::now());
                    if left.is_zero() {
                        return None;
                    }
                    self.changed.wait_timeout(state, left).unwrap_or_else(|p| p.into_inner()).0
                }
            };
        }
        Some(state.clone())
    }

    pub(super) fn update(&self, change: impl FnOnce(&mut Phase)) {
        change(&mut lock(&self.state));
        self.changed.notify_all();
    }
}
