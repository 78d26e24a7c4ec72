//! The lazy ("hot") part of a restore: the tree runs before its memory is local.
//!
//! ```text
//! images written, lazy memory left in the store
//!   -> prefetcher + page server (ours) + `criu lazy-pages` started
//!   -> CRIU restore with lazy pages -> GPU restore -> the tree runs      (first_run_ms)
//!   -> pages arrive on fault and in the background
//!   -> the lazy-pages daemon exits 0: every page is resident            (resident_ms)
//! ```
//! GPU trees: the CUDA restore copies the host copies of device memory back to the GPU all
//! at once, right after CRIU's restore, so those must be in memory first. The checkpoint
//! recorded where they are (the mappings the CUDA checkpoint added, `gpu_host_memory` in the
//! manifest) and [`MemoryMode::Lazy`](crate::store::MemoryMode) restores those runs eagerly.
//!
//! Failure: when memory cannot be served (the store is unreachable past the timeout, a chunk
//! is corrupted, the lazy-pages daemon dies), the tree is killed before the page-server
//! connection closes: a tree whose lazy pages stopped arriving would otherwise read zeros
//! where its memory was. The error says why. Before the tree runs, a `stasis-lazy-guard`
//! process takes copies of the daemon's userfaultfds ([`FaultGuard`]): a daemon that dies on
//! its own leaves the tree's faults waiting (not filled with zeros) until the tree is killed,
//! and if stasisd itself dies the guard kills the tree. (Children the tree forks later get
//! userfaultfds only the daemon holds: for them the kill comes a moment after its death.)

use std::os::fd::{AsRawFd, OwnedFd};
use std::os::unix::net::UnixStream;
use std::sync::Arc;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::time::{Duration, Instant};

use nix::sys::signal::Signal;
use nix::sys::socket::{AddressFamily, SockFlag, SockType, socketpair};
use tracing::{info, warn};

mod guard;

pub(in crate::engine) use guard::{FaultGuard, GuardError, TreePids};

use super::host::Host;
use super::{Engine, ProgressFn, ProgressUpdate, lock};
use crate::criu::CriuError;
use crate::criu::lazy_pages::{LazyPagesDaemon, PageSource, ServeStats, serve_requests};
use crate::criu::pageserver::{HeaderLayout, PageServerError};
use crate::linux::proc;
use crate::linux::reaper::{ExitKind, Reaper};
use crate::store::{LazyFetch, LazyMemory, LazyReader, Manifest};

/// How long the lazy-pages daemon may take to exit after its session ended.
const DAEMON_EXIT_WAIT: Duration = Duration::from_secs(10);
/// How long a failed restore waits to learn whether serving its memory failed first.
const SERVE_END_WAIT: Duration = Duration::from_secs(1);
/// Progress of the lazy phase is reported this often.
const PROGRESS_EVERY: Duration = Duration::from_millis(250);

/// A lazy restore could not complete the tree's memory.
#[derive(Debug, thiserror::Error)]
pub enum LazyError {
    #[error("cannot start CRIU's lazy-pages daemon")]
    Start(#[source] CriuError),
    #[error("serving memory to CRIU's lazy-pages daemon failed")]
    Serve(#[source] PageServerError),
    #[error("CRIU's lazy-pages daemon ended ({}) before all memory was in{}", exit_text(.exit), log_suffix(.log_tail))]
    Daemon { exit: Option<ExitKind>, log_tail: String },
    #[error("the tree could not be guarded, so it was not let run")]
    Guard(#[source] Arc<GuardError>),
}

fn exit_text(exit: &Option<ExitKind>) -> String {
    exit.map_or_else(|| "no exit status".into(), |e| e.to_string())
}

fn log_suffix(tail: &str) -> String {
    crate::criu::log_section("lazy-pages log", tail)
}

/// A lazy restore in progress.
pub(super) struct LazySession {
    daemon: LazyPagesDaemon,
    fetch: LazyFetch,
    server: tokio::task::JoinHandle<Result<ServeStats, PageServerError>>,
    /// Set once CRIU starts creating the tree: from then on a failure kills it.
    armed: Arc<AtomicBool>,
    served: Arc<AtomicU64>,
    total: u64,
    guard: FaultGuard,
    /// Kills the restored tree (and whatever it started since).
    kill: KillTree,
}

/// Kills a restored tree: the processes of the checkpoint and whatever each started since.
pub(super) type KillTree = Arc<dyn Fn() + Send + Sync>;

/// The roots of a restored tree, as far as known: the recorded pids, or for a tree with its
/// own pid namespace the root CRIU created (known from the pre-resume notification on).
pub(super) type Roots = Arc<std::sync::Mutex<Vec<i32>>>;

/// Kills the trees of `roots`, with whatever they forked meanwhile.
pub(super) fn tree_killer(host: Arc<dyn Host>, roots: Roots) -> KillTree {
    Arc::new(move || {
        let roots = lock(&roots).clone();
        host.signal(&host.trees(&roots), Signal::SIGKILL)
    })
}

/// The page server's view of the prefetcher; counts what it serves.
struct Served {
    reader: LazyReader,
    served: Arc<AtomicU64>,
}

impl PageSource for Served {
    fn read(
        &mut self,
        pid: u64,
        vaddr: u64,
        max_bytes: u64,
        out: &mut Vec<u8>,
    ) -> Result<(), Box<dyn std::error::Error + Send + Sync>> {
        self.reader.read(pid, vaddr, max_bytes, out)?;
        self.served.fetch_add(out.len() as u64, Ordering::Relaxed);
        Ok(())
    }
}

/// Serves CRIU's lazy-pages daemon on `conn` from `source`, in a blocking thread; once `armed`
/// (the tree exists), a failure kills the tree before the connection closes.
fn serve(
    conn: OwnedFd,
    layout: HeaderLayout,
    mut source: Served,
    armed: Arc<AtomicBool>,
    kill: KillTree,
) -> tokio::task::JoinHandle<Result<ServeStats, PageServerError>> {
    tokio::task::spawn_blocking(move || {
        let mut conn = UnixStream::from(conn);
        let result = serve_requests(&mut conn, layout, &mut source);
        if let Err(e) = &result
            && armed.load(Ordering::SeqCst)
        {
            warn!(error = %crate::error_chain(e), "lazy restore failed: killing the restored tree");
            kill();
        }
        // Only now may the daemon see the connection close.
        drop(conn);
        result
    })
}

impl Engine {
    /// Starts serving `memory` for a restore from `dir`: the prefetcher, our page server and
    /// CRIU's lazy-pages daemon, which is ready for the restore when this returns.
    pub(super) async fn start_lazy(
        &self,
        manifest: &Manifest,
        dir: &std::path::Path,
        memory: LazyMemory,
        roots: Roots,
    ) -> Result<LazySession, LazyError> {
        let kill = tree_killer(self.host.clone(), roots.clone());
        let (total, lazy_tasks) = (memory.bytes(), memory.tasks());
        let (ours, theirs): (OwnedFd, OwnedFd) =
            socketpair(AddressFamily::Unix, SockType::Stream, None, SockFlag::SOCK_CLOEXEC)
                .map_err(|e| LazyError::Start(CriuError::Io(e.into())))?;
        let (reader, fetch) = self.store.start_lazy_fetch(memory, self.lazy);
        let armed = Arc::new(AtomicBool::new(false));
        let served = Arc::new(AtomicU64::new(0));
        let layout = HeaderLayout::for_version(self.criu_version.major, self.criu_version.minor);
        let source = Served { reader, served: served.clone() };
        let server = serve(ours, layout, source, armed.clone(), kill.clone());
        let criu = self.criu.clone();
        let images = dir.to_path_buf();
        let started = tokio::task::spawn_blocking(move || {
            let daemon = criu.start_lazy_pages(&images, theirs.as_raw_fd());
            drop(theirs);
            daemon
        })
        .await
        .map_err(|e| LazyError::Start(CriuError::Io(std::io::Error::other(e))));
        match started.and_then(|d| d.map_err(LazyError::Start)) {
            Ok(daemon) => {
                // The daemon is ready, so alive: an exit recorded for its pid is an earlier one's.
                self.reaper.forget_earlier_exit(daemon.pid);
                let tree = match (manifest.pod.is_some(), manifest.own_pid_namespace) {
                    (true, _) => TreePids::InContainer(roots),
                    (false, true) => TreePids::InNamespace(roots),
                    (false, false) => {
                        let mut pids = vec![manifest.root_pid];
                        pids.extend(manifest.pids.iter().filter(|p| **p != manifest.root_pid));
                        TreePids::Recorded(pids)
                    }
                };
                let guard = FaultGuard::new(daemon.pid, self.reaper.clone(), tree, lazy_tasks);
                Ok(LazySession { daemon, fetch, server, armed, served, total, guard, kill })
            }
            Err(e) => {
                fetch.stop();
                Err(e)
            }
        }
    }
}

impl LazySession {
    /// CRIU is about to create the tree: failures from now on kill it.
    pub(super) fn arm(&self) {
        self.armed.store(true, Ordering::SeqCst);
    }

    /// The guard to start at CRIU's "pre-resume" notification.
    pub(super) fn fault_guard(&self) -> FaultGuard {
        self.guard.clone()
    }

    /// Why serving memory failed, if it did: when CRIU's restore fails because serving its
    /// pages failed (and the serving side killed the tree), that is the reason to report, not
    /// CRIU's "killed by signal 9". Waits a moment for the serving side to finish.
    pub(super) async fn serve_failure(&mut self) -> Option<LazyError> {
        match tokio::time::timeout(SERVE_END_WAIT, &mut self.server).await {
            Ok(Ok(Err(e))) => Some(LazyError::Serve(e)),
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
        // A tree already let run (the guard started) is killed here; CRIU removes one it
        // could not restore.
        if let Some(guard) = self.guard.take() {
            (self.kill)();
            guard.release();
        }
        proc::signal_all(&[self.daemon.pid], Signal::SIGKILL);
        self.fetch.stop();
    }

    /// The tree runs: watches the session from now on, in a task that ends when every page is
    /// resident, with the bytes fetched from the store and when that was; on failure the tree
    /// has been killed. The guard is let go as soon as the lazy-pages daemon is done: from then
    /// on nobody answers faults, so a held userfaultfd would stall the tree (on pages it never
    /// had, or in the CUDA restore that may still be running).
    pub(super) fn watch(
        self,
        reaper: Reaper,
        progress: ProgressFn,
    ) -> tokio::task::JoinHandle<Result<(u64, Instant), LazyError>> {
        tokio::spawn(async move { self.finish(&reaper, &progress).await })
    }

    async fn finish(self, reaper: &Reaper, progress: &ProgressFn) -> Result<(u64, Instant), LazyError> {
        let LazySession { daemon, fetch, mut server, served, total, guard, kill, .. } = self;
        let served_result = loop {
            progress(ProgressUpdate { phase: "memory", done: served.load(Ordering::Relaxed), total });
            tokio::select! {
                r = &mut server => break r,
                () = tokio::time::sleep(PROGRESS_EVERY) => {}
            }
        };
        // The daemon exits once it said goodbye or saw the connection close.
        let exit = match tokio::time::timeout(DAEMON_EXIT_WAIT, reaper.wait_exit(daemon.pid)).await {
            Ok(exit) => Some(exit),
            Err(_) => {
                proc::signal_all(&[daemon.pid], Signal::SIGKILL);
                tokio::time::timeout(DAEMON_EXIT_WAIT, reaper.wait_exit(daemon.pid)).await.ok()
            }
        };
        fetch.stop();
        let outcome = match served_result {
            Err(e) => Err(LazyError::Serve(PageServerError::Io(std::io::Error::other(e)))),
            Ok(Err(e)) => Err(LazyError::Serve(e)),
            Ok(Ok(_)) if exit != Some(ExitKind::Exited(0)) => {
                Err(LazyError::Daemon { exit, log_tail: crate::criu::log_tail_of(&daemon.log) })
            }
            Ok(Ok(stats)) => {
                info!(
                    requests = stats.requests,
                    bytes = stats.bytes,
                    fetched = fetch.bytes_fetched(),
                    "lazy memory resident"
                );
                Ok((fetch.bytes_fetched(), Instant::now()))
            }
        };
        if outcome.is_err() {
            kill();
        }
        if let Some(guard) = guard.take() {
            guard.release();
        }
        progress(ProgressUpdate { phase: "memory", done: served.load(Ordering::Relaxed), total });
        outcome
    }
}
