//! Restored memory served by stasisd itself: the tree's lazy memory is put in place through
//! its userfaultfds (server.rs) straight from the store, never written to the images
//! directory. A lazy ("hot") restore lets the tree run meanwhile; an eager one holds it at
//! CRIU's "pre-resume" until every page is in, so that it never runs without its memory.
//!
//! ```text
//! images written, lazy memory left in the store
//!   -> prefetcher + fault server listening on the work directory's lazy-pages.socket
//!   -> CRIU restore with lazy pages: each process's userfaultfd to the server
//!   -> pre-resume: the guard takes copies of the userfaultfds; eager: wait until resident
//!   -> the tree runs (first_run_ms) -> GPU restore
//!   -> pages arrive on fault and in the background -> all in place (resident_ms)
//! ```
//! An eager restore's chunks are put in place by the threads that decode them once each
//! process's userfaultfd is here and CRIU has registered its memory (direct.rs); the server
//! fills in the rest (chunks that came before, zero chunks, copies refused).
//! GPU trees: the CUDA restore copies the host copies of device memory back to the GPU all
//! at once, right after CRIU's restore, so a lazy restore restores those eagerly (the
//! checkpoint recorded where they are: `gpu_host_memory` in the manifest).
//!
//! Failure: when memory cannot be put in place (the store is unreachable past the timeout, a
//! chunk is corrupted, a page is not where CRIU registered it), the tree is killed before the
//! userfaultfds close: a tree whose lazy pages stopped arriving would otherwise read zeros
//! where its memory was. The error says why. From "pre-resume" on, a `stasis-lazy-guard`
//! process holds copies of the userfaultfds ([`FaultGuard`]): if stasisd itself dies, faults
//! wait (not filled with zeros) and the guard kills the tree. Children the tree forks later
//! are handed to the guard as they come.

use std::sync::Arc;
use std::sync::atomic::{AtomicBool, Ordering};
use std::time::{Duration, Instant};

use nix::sys::signal::Signal;
use tracing::{info, warn};

mod control;
mod direct;
mod events;
mod fill;
mod guard;
mod pages;
mod read_ahead;
#[cfg(test)]
mod serve_tests;
mod server;

use control::Control;
use direct::Direct;
pub(in crate::engine) use guard::{FaultGuard, GuardError, TreePids};
pub use server::FaultServerError;
use server::{FaultServer, ServeStats};

use super::host::Host;
use super::{Engine, ProgressFn, ProgressUpdate, lock};
use crate::criu::RunningCriu;
use crate::criu::images::{read_pstree, write_empty_parent};
use crate::criu::lazy_socket::{LazyListener, LazySocketError};
use crate::store::{FetchSettings, LazyFetch, LazyMemory, Manifest};

/// How long a failed restore waits to learn whether serving its memory failed first.
const SERVE_END_WAIT: Duration = Duration::from_secs(1);
/// Progress of the lazy phase is reported this often.
const PROGRESS_EVERY: Duration = Duration::from_millis(250);
/// Fetched memory an eager restore holds before it is in place, at most.
const EAGER_CACHE_BYTES: u64 = 256 << 20;

/// Serving a restore's memory failed.
#[derive(Debug, thiserror::Error)]
pub enum LazyError {
    #[error("cannot get ready to serve the restore's memory")]
    Start(#[source] std::io::Error),
    #[error("putting the restored tree's memory in place failed")]
    Serve(#[source] Box<FaultServerError>),
    #[error("the server of the tree's memory ended abnormally: {0}")]
    Task(String),
    #[error("the tree could not be guarded, so it was not let run")]
    Guard(#[source] Arc<GuardError>),
}

/// A restore whose memory stasisd serves, in progress.
pub(super) struct LazySession {
    fetch: LazyFetch,
    server: tokio::task::JoinHandle<Result<ServeStats, FaultServerError>>,
    control: Arc<Control>,
    /// Set once CRIU starts creating the tree: from then on a failure kills it.
    armed: Arc<AtomicBool>,
    total: u64,
    guard: FaultGuard,
    /// Every page in place before the tree runs (an eager restore).
    hold: bool,
    /// Kills the restored tree (and whatever it started since).
    kill: KillTree,
    /// The CRIU restoring the tree, while it does.
    criu: RunningCriu,
}

/// Kills a restored tree: the processes of the checkpoint and whatever each started since.
pub(super) type KillTree = Arc<dyn Fn() + Send + Sync>;

/// The roots of a restored tree, as far as known: the recorded pids, or for a tree with its
/// own pid namespace the root CRIU created (known from the pre-resume notification on).
pub(super) type Roots = Arc<std::sync::Mutex<Vec<i32>>>;

/// Kills the trees of `roots`, with whatever they forked meanwhile; while a CRIU is at work on
/// them (`criu` holds its pid), CRIU too, and the tree it is restoring though its roots are not
/// known yet. A CRIU left alive would deadlock with the tree: it traces the tree until it
/// resumes it, so each killed process waits for CRIU to reap it, the namespace's init waits
/// for them all, and CRIU waits for the init.
pub(super) fn tree_killer(host: Arc<dyn Host>, roots: Roots, criu: RunningCriu) -> KillTree {
    Arc::new(move || {
        let mut roots = lock(&roots).clone();
        let mut doomed = Vec::new();
        match criu.load(Ordering::SeqCst) {
            0 => {}
            criu => {
                roots.extend(host.restoring_roots(criu));
                doomed.extend(host.trees(&[criu]));
            }
        }
        doomed.extend(host.trees(&roots));
        host.signal(&doomed, Signal::SIGKILL)
    })
}

impl Engine {
    /// Starts serving `memory` for a restore whose images are in `dir`: the prefetcher, and
    /// the fault server, listening for CRIU's restore when this returns. With `hold`, the tree
    /// runs only once every page is in place (an eager restore).
    pub(super) fn start_lazy(
        &self,
        manifest: &Manifest,
        dir: &std::path::Path,
        memory: LazyMemory,
        roots: Roots,
        hold: bool,
    ) -> Result<LazySession, LazyError> {
        let criu = RunningCriu::default();
        let kill = tree_killer(self.deps.host.clone(), roots.clone(), criu.clone());
        let pstree = std::fs::read(dir.join("pstree.img")).and_then(|data| read_pstree(&data));
        let pstree = pstree.map_err(LazyError::Start)?;
        let processes = pstree.len();
        // CRIU puts memory in place with transparent huge pages off (see there).
        write_empty_parent(dir, pstree.iter().map(|(pid, _)| *pid)).map_err(LazyError::Start)?;
        let listener = LazyListener::bind(dir).map_err(LazyError::Start)?;
        let control = Arc::new(Control::new().map_err(LazyError::Start)?);
        let total = memory.bytes();
        // An eager restore puts chunks in place as fast as they arrive: a little cache keeps
        // the store busy, all of it the prefetcher's (no fault can come); a lazy one holds
        // more, ahead of the tree's faults.
        let settings = match hold {
            true => {
                let cache_bytes = self.settings.lazy.cache_bytes.min(EAGER_CACHE_BYTES);
                FetchSettings { cache_bytes, prefetch_bytes: cache_bytes, ..self.settings.lazy }
            }
            false => self.settings.lazy,
        };
        // A lazy restore fetches only what faults ask for until CRIU is done: the tree's first
        // run comes first. An eager one's chunks are put in place by the threads that decode
        // them once each process's userfaultfd is here (those decoded before are cached: the
        // prefetch starts at once, while CRIU restores the rest of the tree).
        let direct = hold.then(|| Arc::new(Direct::default()));
        let placer = direct.clone().map(|d| d as Arc<dyn crate::store::Placer>);
        let (chunks, fetch) =
            self.deps.store.start_lazy_fetch(memory, settings, hold, placer).map_err(LazyError::Start)?;
        let armed = Arc::new(AtomicBool::new(false));
        let server = FaultServer::new(
            self.deps.host.clone(),
            listener,
            processes,
            chunks,
            self.settings.lazy.timeout,
            control.clone(),
            direct,
        );
        let server = {
            let (armed, kill) = (armed.clone(), kill.clone());
            tokio::task::spawn_blocking(move || {
                server.run(|e| {
                    if armed.load(Ordering::SeqCst) {
                        warn!(error = %crate::error_chain(e), "putting restored memory in place failed: killing the restored tree");
                        kill();
                    }
                })
            })
        };
        let tree = match (manifest.pod.is_some(), manifest.own_pid_namespace) {
            (true, _) => TreePids::InContainer(roots),
            (false, true) => TreePids::InNamespace(roots),
            (false, false) => {
                let mut pids = vec![manifest.root_pid];
                pids.extend(manifest.pids.iter().filter(|p| **p != manifest.root_pid));
                TreePids::Recorded(pids)
            }
        };
        let guard = FaultGuard::new(self.deps.host.clone(), control.clone(), tree);
        Ok(LazySession { fetch, server, control, armed, total, guard, hold, kill, criu })
    }
}

impl LazySession {
    /// CRIU is about to create the tree: failures from now on kill it.
    pub(super) fn arm(&self) {
        self.armed.store(true, Ordering::SeqCst);
    }

    /// Where CRIU's restore records its pid while it runs (see [`tree_killer`]).
    pub(super) fn running_criu(&self) -> RunningCriu {
        self.criu.clone()
    }

    /// Whether the tree runs before its memory is all in place.
    pub(super) fn is_lazy(&self) -> bool {
        !self.hold
    }

    /// The guard to start at CRIU's "pre-resume" notification.
    pub(super) fn fault_guard(&self) -> FaultGuard {
        self.guard.clone()
    }

    /// What to do at CRIU's (process `criu`'s) "pre-resume", before the tree runs: have the
    /// guard hold its userfaultfds; for an eager restore, then wait until every page is in
    /// place, let the guard go and close the server, so that the tree runs as if restored
    /// from image files. When the guard cannot hold them or memory cannot be put in place,
    /// the tree is killed before it runs (CRIU only logs a failed notification), and the
    /// reason returned.
    pub(super) fn pre_resume(&self) -> impl Fn(i32) -> Result<(), String> + Send + 'static {
        let (control, guard, hold, kill) =
            (self.control.clone(), self.guard.clone(), self.hold, self.kill.clone());
        move |criu| {
            // The guard learns the tree's roots (those of a renumbered tree are known only
            // now), so the kill below reaches them.
            let settled = guard.start(criu).map_err(|e| crate::error_chain(e.as_ref())).and_then(|()| {
                match control.outcome() {
                    Some((Err(why), _)) => Err(why),
                    _ if hold => {
                        control.wait_resident()?;
                        guard.release();
                        control.close();
                        Ok(())
                    }
                    _ => Ok(()),
                }
            });
            if settled.is_err() {
                kill();
            }
            settled
        }
    }

    /// Why serving memory failed, if it did: when CRIU's restore fails because serving its
    /// pages failed (and the serving side killed the tree), that is the reason to report, not
    /// CRIU's "killed by signal 9". CRIU closing its lazy-pages connection early is no such
    /// reason: it follows from CRIU's own failure, which its log tells. Waits a moment for the
    /// serving side to finish.
    pub(super) async fn serve_failure(&mut self) -> Option<LazyError> {
        match tokio::time::timeout(SERVE_END_WAIT, &mut self.server).await {
            Ok(Ok(Err(
                FaultServerError::Stopped | FaultServerError::Protocol(LazySocketError::Closed(_)),
            ))) => None,
            Ok(Ok(Err(e))) => Some(LazyError::Serve(Box::new(e))),
            _ => None,
        }
    }

    /// Kills the tree this session serves (and whatever it started).
    pub(super) fn kill_tree(&self) {
        (self.kill)();
    }

    /// Ends a session whose restore failed.
    pub(super) fn abort(self) {
        self.armed.store(false, Ordering::SeqCst);
        // A tree already let run (the guard holds it) is killed here; CRIU removes one it
        // could not restore.
        if self.guard.holding() {
            (self.kill)();
        }
        self.guard.release();
        self.control.stop();
        self.fetch.stop();
    }

    /// The tree runs: watches the session from now on, in a task that ends when every page is
    /// resident, with the bytes fetched from the store and when that was; on failure the tree
    /// has been killed. Once every page is in, the guard is let go and the server closed.
    pub(super) fn watch(
        self,
        progress: ProgressFn,
    ) -> tokio::task::JoinHandle<Result<(u64, Instant), LazyError>> {
        tokio::spawn(async move { self.finish(&progress).await })
    }

    async fn finish(self, progress: &ProgressFn) -> Result<(u64, Instant), LazyError> {
        let LazySession { fetch, mut server, control, total, guard, kill, .. } = self;
        let mut ended = None;
        while control.outcome().is_none() {
            progress(ProgressUpdate { phase: "memory", done: control.placed(), total });
            tokio::select! {
                r = &mut server => {
                    ended = Some(r);
                    break;
                }
                () = tokio::time::sleep(PROGRESS_EVERY) => {}
            }
        }
        let resident_at = control.outcome().map_or_else(Instant::now, |(_, at)| at);
        if control.outcome().is_some_and(|(o, _)| o.is_err()) {
            kill();
        }
        // The guard goes first, then the server closes the userfaultfds: from then on the
        // kernel handles the tree's faults.
        guard.release();
        control.stop();
        let served = match ended {
            Some(r) => r,
            None => server.await,
        };
        fetch.stop();
        progress(ProgressUpdate { phase: "memory", done: control.placed(), total });
        match served {
            Err(e) => {
                kill();
                Err(LazyError::Task(e.to_string()))
            }
            Ok(Err(e)) => Err(LazyError::Serve(Box::new(e))),
            Ok(Ok(stats)) => {
                info!(
                    faults = stats.faults,
                    max_fault_wait_ms = stats.max_fault_wait.as_millis() as u64,
                    bytes = stats.bytes_placed,
                    processes = stats.processes,
                    fetched = fetch.bytes_fetched(),
                    "restored memory resident"
                );
                Ok((fetch.bytes_fetched(), resident_at))
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::engine::host::fake::FakeHost;

    #[test]
    fn a_tree_killed_while_criu_holds_it_takes_criu_with_it() {
        const ROOT: i32 = 4_194_401;
        const CRIU: i32 = 4_194_410;
        let host = Arc::new(FakeHost::default());
        let criu = RunningCriu::default();
        let kill = tree_killer(host.clone(), Arc::new(std::sync::Mutex::new(vec![ROOT])), criu.clone());
        kill();
        assert_eq!(host.signals_of(Signal::SIGKILL), [ROOT], "no CRIU runs: the tree alone");
        criu.store(CRIU, Ordering::SeqCst);
        kill();
        let killed = host.signals_of(Signal::SIGKILL);
        assert!(killed[1..].contains(&CRIU) && killed[1..].contains(&ROOT), "{killed:?}");
    }
}
