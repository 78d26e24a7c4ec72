//! The checkpoint job.
//!
//! ```text
//! resolve target -> inspect tree (CRIU options; refusals before anything is touched)
//!   -> GPU phase -> CRIU dump (tree frozen; afterwards left running, or left stopped for
//!   eviction) -> upload pages and images -> write manifest (commit)
//!   -> eviction: kill the stopped tree
//! on any failure after the GPU phase: the tree is given back as it was (`rollback.rs`)
//! ```

mod crash_record;
pub(super) mod dump;
mod frozen_memory;
mod left_running;
mod rollback;
mod store;
mod tracking;

use std::path::Path;
use std::sync::Arc;
use std::time::{Duration, Instant};

use nix::sys::signal::Signal;
use tracing::{info, instrument, warn};

use super::access::{Caller, owner_of};
use super::idle::ReclaimUses;
use super::ids::{checkpoint_id, ms, now_unix_ms};
use super::inspect::TreeInfo;
use super::workloads::{Workload, derived_name};
use super::{CheckpointCost, CheckpointError, Engine, ProgressFn, ProgressUpdate};
use crate::criu::{DumpSpec, NetworkLock};
use crate::metrics::{CheckpointSample, Failure, Metrics};
use crate::pages::PageSink;
use crate::store::DumpPages;
use rollback::Hold;
pub(in crate::engine) use store::tree_options;
use store::{DumpTiming, Dumped};
pub(super) use tracking::Chains;
use tracking::Tracking;
pub(super) use tracking::tracking_report;

/// Which tree to checkpoint.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Target {
    Pid(i32),
    Workload(String),
}

pub struct CheckpointParams {
    pub target: Target,
    /// Keep the tree running afterwards; otherwise it is stopped once the checkpoint is stored.
    pub leave_running: bool,
    /// An answer before the job ends, for callers that do not wait for all of it.
    pub answer_early: Option<EarlyAnswer>,
    /// An idle reclaim (see `engine/idle/`): if the workload counts as used once the dump has
    /// stopped it, the stored tree is given back rather than stopped. Its network lock is kept
    /// for the waker, not swept.
    pub reclaim: Option<Arc<ReclaimUses>>,
    /// On whose behalf: a user other than root may checkpoint only a tree wholly its own.
    pub caller: Caller,
}

/// A checkpoint's outcome, told before its job ends.
pub struct EarlyAnswer {
    pub when: AnswerWhen,
    pub send: Box<dyn FnOnce(CheckpointOutcome) + Send>,
}

/// When an [`EarlyAnswer`] is given.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum AnswerWhen {
    /// Once the tree runs again (or is held stopped), before the checkpoint is stored, with
    /// what is known then.
    Resumed,
    /// Once the checkpoint is durable, before an evicted tree is killed, the registry updated
    /// and retention applied (a restore of the workload waits for those).
    Durable,
}

impl std::fmt::Debug for CheckpointParams {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("CheckpointParams")
            .field("target", &self.target)
            .field("leave_running", &self.leave_running)
            .field("answer_early", &self.answer_early.as_ref().map(|a| a.when))
            .field("reclaim", &self.reclaim)
            .field("caller", &self.caller)
            .finish()
    }
}

/// Timings and sizes of one checkpoint: the store's message, which the manifest keeps and the
/// API reports as they are.
pub use stasis_proto::stasis::store::v1::CheckpointStats;

#[derive(Debug, Clone, PartialEq, Eq)]
pub struct CheckpointOutcome {
    pub id: String,
    pub workload: String,
    pub pid: i32,
    pub left_running: bool,
    /// Whether the checkpoint is stored (false only in an early answer once resumed).
    pub durable: bool,
    pub stats: CheckpointStats,
}

/// How long an evicted tree may take to disappear after SIGKILL.
const KILL_WAIT: Duration = Duration::from_secs(5);

/// One checkpoint in progress: what the steps after the dump need to know.
struct Job {
    id: String,
    workload: String,
    pid: i32,
    created_unix_ms: u64,
    started: Instant,
    leave_running: bool,
    /// What an idle reclaim knows of the workload's uses (see [`CheckpointParams::reclaim`]).
    reclaim: Option<Arc<ReclaimUses>>,
}

/// Called once the tree runs again (or is held stopped), before the checkpoint is stored.
type OnResumed = Option<Box<dyn FnOnce(CheckpointOutcome) + Send>>;

impl Engine {
    /// Checkpoints a tree, as a job that finishes even if the caller goes away.
    pub async fn checkpoint(
        self: &Arc<Self>,
        params: CheckpointParams,
        progress: ProgressFn,
    ) -> Result<CheckpointOutcome, CheckpointError> {
        if self.jobs.is_closed() {
            return Err(CheckpointError::ShuttingDown);
        }
        let this = self.clone();
        let job = async move { this.checkpoint_job(params, progress).await };
        let joined = self.tracked("checkpoint", job, record_checkpoint).await;
        joined.map_err(CheckpointError::panicked("checkpoint job"))?
    }

    fn resolve_target(&self, target: &Target) -> Result<(String, i32), CheckpointError> {
        match target {
            Target::Pid(pid) => {
                if !self.deps.host.is_running(*pid) {
                    return Err(CheckpointError::NoSuchProcess(*pid));
                }
                let name = match self.registry.by_pid(*pid) {
                    Some(w) => w.name,
                    None => {
                        let program = self.deps.host.command(*pid).ok().and_then(|c| c.into_iter().next());
                        derived_name(&program.unwrap_or_default(), &pid.to_string())
                    }
                };
                Ok((name, *pid))
            }
            Target::Workload(name) => {
                let w =
                    self.registry.get(name).ok_or_else(|| CheckpointError::UnknownWorkload(name.clone()))?;
                if let Some(c) = &w.container {
                    let root = self
                        .container_tree_root(&w, c)
                        .map_err(|source| CheckpointError::Container { workload: w.name.clone(), source })?;
                    return Ok((w.name, root));
                }
                if !self.deps.host.is_running(w.pid) {
                    return Err(CheckpointError::NotRunning { workload: w.name, pid: w.pid });
                }
                Ok((w.name, w.pid))
            }
        }
    }

    #[instrument(skip_all, fields(target = ?params.target, leave_running = params.leave_running))]
    async fn checkpoint_job(
        &self,
        params: CheckpointParams,
        progress: ProgressFn,
    ) -> Result<CheckpointOutcome, CheckpointError> {
        let started = Instant::now();
        let (workload, pid) = self.resolve_target(&params.target)?;
        let _guard = self.lock_workload(&workload).await;
        let tree = self.prepare_tree(&workload, pid, params.caller)?;
        let created_unix_ms = now_unix_ms();
        let id = checkpoint_id(created_unix_ms);
        let work = self
            .deps
            .state
            .new_work_dir(&id)
            .map_err(|source| CheckpointError::Local { what: "work directory", source })?;
        info!(checkpoint = %id, workload = %workload, pid, pids = tree.pids.len(), options = ?tree.options.describe(), "dumping");
        let leave_running = params.leave_running;
        let job = Job { id, workload, pid, created_unix_ms, started, leave_running, reclaim: params.reclaim };
        let container_init = self.registry.get(&job.workload).and_then(|w| w.container).map(|c| c.init_pid);
        let mut hold = Hold::new(self, &job.id, &tree, work.path(), container_init);
        match self.suspend_gpu(&tree.pids, container_init, &progress).await {
            Ok(suspended) => hold.suspended_gpu(suspended),
            Err(e) => return Err(hold.give_back(e).await),
        }
        let (on_resumed, on_durable) = match params.answer_early {
            Some(EarlyAnswer { when: AnswerWhen::Resumed, send }) => (Some(send), None),
            Some(EarlyAnswer { when: AnswerWhen::Durable, send }) => (None, Some(send)),
            None => (None, None),
        };
        let stored = self.dump_and_store(&job, on_resumed, &mut hold, &tree, work.path(), &progress).await;
        if let (Ok(stats), Some(send)) = (&stored, on_durable) {
            send(job.outcome(true, *stats));
        }
        match stored {
            Ok(stats) if self.reclaim_backs_off(&job, &tree, work.path()) => {
                // What could not be undone is logged; the checkpoint itself is good.
                hold.resume().await;
                let job = Job { leave_running: true, ..job };
                Ok(self.finish(job, &tree, work.path(), stats).await)
            }
            Ok(stats) => {
                hold.release();
                Ok(self.finish(job, &tree, work.path(), stats).await)
            }
            Err(e) => Err(hold.give_back(e).await),
        }
    }

    /// Whether `job` is an idle reclaim that must give its stopped tree (images in `images`)
    /// back rather than stop it: the workload counts as used (see [`ReclaimUses::at_stop`]).
    fn reclaim_backs_off(&self, job: &Job, tree: &TreeInfo, images: &Path) -> bool {
        let Some(uses) = job.reclaim.as_ref().filter(|_| !job.leave_running) else { return false };
        let Some(in_use) = uses.at_stop(self.deps.host.as_ref(), &self.tree_now(tree), images) else {
            return false;
        };
        in_use.log(&job.id);
        true
    }

    /// Inspects the tree of `pid` and refuses, before anything touches it, what cannot be
    /// dumped.
    fn prepare_tree(&self, workload: &str, pid: i32, caller: Caller) -> Result<TreeInfo, CheckpointError> {
        if !self.deps.host.is_running(pid) {
            return Err(CheckpointError::NoSuchProcess(pid));
        }
        if let Some(what) = self.deps.host.untouchable(pid) {
            return Err(CheckpointError::Untouchable { pid, reason: format!("it is {what}") });
        }
        let mut tree =
            self.deps.host.inspect(pid).map_err(|source| CheckpointError::Inspect { pid, source })?;
        if caller != Caller::Root && tree.uids.iter().any(|&uid| uid != caller.uid()) {
            return Err(CheckpointError::NotYours { pid, uids: tree.uids.iter().copied().collect() });
        }
        if let Some(reason) = tree.unsupported.clone() {
            return Err(CheckpointError::Untouchable { pid, reason });
        }
        // A tree holding stasisd (its parent shell's, say) would have stasisd freeze itself.
        if let Some((held, what)) = tree.pids.iter().find_map(|&p| Some((p, self.deps.host.untouchable(p)?)))
        {
            return Err(CheckpointError::Untouchable {
                pid,
                reason: format!("its tree holds process {held}, {what}"),
            });
        }
        if let Some(why) = self.deps.host.unrecordable_session(pid) {
            return Err(CheckpointError::Untouchable { pid, reason: format!("it is {why}") });
        }
        if let Some(reason) = tree.sockets.refusal(&self.support.network_sockets, &self.support.network_lock)
        {
            return Err(CheckpointError::Sockets { workload: workload.into(), reason });
        }
        if tree.options.tcp_established {
            tree.options.network_lock = self.support.network_lock.as_ref().ok().copied();
        }
        Ok(tree)
    }

    /// Dumps the tree, lets it run on (or keeps it stopped), and stores the checkpoint.
    async fn dump_and_store(
        &self,
        job: &Job,
        on_resumed: OnResumed,
        hold: &mut Hold<'_>,
        tree: &TreeInfo,
        images: &Path,
        progress: &ProgressFn,
    ) -> Result<CheckpointStats, CheckpointError> {
        if !job.leave_running {
            return self.dump_while_storing(job, on_resumed, hold, tree, images, progress).await;
        }
        self.dump_left_running(job, on_resumed, hold, tree, images, progress).await
    }

    /// A tree that will not run on (an eviction, a migration): its pages are stored as CRIU
    /// sends them, so the checkpoint is durable sooner; it stays stopped meanwhile.
    async fn dump_while_storing(
        &self,
        job: &Job,
        on_resumed: OnResumed,
        hold: &mut Hold<'_>,
        tree: &TreeInfo,
        images: &Path,
        progress: &ProgressFn,
    ) -> Result<CheckpointStats, CheckpointError> {
        let store_err = |source| CheckpointError::Store { id: job.id.clone(), source: Box::new(source) };
        self.begin_storing(&job.id, tree, images)?;
        // The commit guard comes first: once CRIU sends, the chunker must be taking blocks.
        // Blocks come from the daemon's shared pool, and a chunker waiting for a guard (behind
        // a garbage collection that waits for a dump's guard) would hold them from that dump.
        let guard = match self.deps.store.begin_commit().await {
            Ok(guard) => guard,
            Err(e) => {
                self.settle_store(&job.id, false);
                return Err(store_err(e));
            }
        };
        let tracking = self.begin_tracking(&job.workload, job.pid, tree, images);
        let (sink, source) = crate::store::stream(&self.shared.blocks);
        let sink = tracking.reading_tree(self, tree, sink);
        let dumping = async {
            let (timing, sink) = self.dump_tree(job, tree, images, progress, sink, &tracking).await?;
            sink.finish().map_err(|source| CheckpointError::Local { what: "page stream", source })?;
            job.resumed(&timing, on_resumed, progress);
            Ok::<_, CheckpointError>(timing)
        };
        let storing =
            self.store_pages(DumpPages::Streamed(source, tracking.store_parent(self)), images, progress);
        let (dumped, stored) = tokio::join!(dumping, storing);
        let committed = match (dumped, stored) {
            (Ok(timing), Ok(stored)) => {
                let dumped = job.dumped(tree, timing, hold, 0);
                self.commit_checkpoint(dumped, &guard, stored).await.map_err(store_err)
            }
            // The dump failed first; the store only saw its pages stop.
            (Err(e), Err(crate::store::StoreError::DumpUnfinished) | Ok(_)) => Err(e),
            // The store failed (and the dump with it, if it was not over).
            (_, Err(e)) => Err(store_err(e)),
        };
        self.settle_store(&job.id, committed.is_ok());
        committed
    }

    /// Runs CRIU's dump with stasisd's page server feeding `sink`, tracking memory as
    /// `tracking` says; returns the dump's timing and the sink.
    async fn dump_tree<S: PageSink + Send + 'static>(
        &self,
        job: &Job,
        tree: &TreeInfo,
        images: &Path,
        progress: &ProgressFn,
        sink: S,
        tracking: &Tracking,
    ) -> Result<(DumpTiming, S), CheckpointError> {
        progress(ProgressUpdate { phase: "dump", done: 0, total: 0 });
        let _init_dir = match &tree.init_dir {
            Some(dir) => {
                let held = super::parts::hold(&self.shared.init_dir_locks, dir.clone()).await;
                if let Err(e) = crate::criu::parasite::clear_leftovers(dir) {
                    warn!(workload = %job.workload, dir = %dir.display(), error = %e, "cannot clear what an interrupted dump left; the dump may fail");
                }
                Some(held)
            }
            None => None,
        };
        let (pid, enter) = match self.registry.get(&job.workload).and_then(|w| w.container) {
            None => (job.pid, None),
            Some(c) => {
                let inner = self.deps.host.pid_inside(job.pid, c.init_pid).unwrap_or(job.pid);
                let enter = super::pods::enter(self.deps.host.as_ref(), &c, false)
                    .map_err(|source| CheckpointError::Local { what: "entering the container", source })?;
                (inner, Some(enter))
            }
        };
        let spec = DumpSpec {
            pid,
            images_dir: images.to_path_buf(),
            tree: tree.options.clone(),
            leave_running: job.leave_running,
            leave_stopped: !job.leave_running,
            page_server_fd: None,
            enter,
            track_mem: tracking.on,
            parent: tracking.criu_parent(),
        };
        let (criu, version, parent) = (self.deps.criu.clone(), self.support.version, tracking.parent.clone());
        let dumped =
            tokio::task::spawn_blocking(move || dump::dump(criu.as_ref(), version, spec, sink, parent))
                .await
                .map_err(CheckpointError::panicked("dump thread"))?;
        let (frozen_at, sink) = dumped.map_err(|failure| failure.into_error(job.workload.clone()))?;
        let dump_done = Instant::now();
        // Unknown only from a CRIU that ran no action scripts: then the whole job counts.
        let frozen_ms = ms(dump_done - frozen_at.unwrap_or(job.started));
        Ok((DumpTiming { started: job.started, dump_done, frozen_ms }, sink))
    }

    /// The checkpoint is stored: an evicted tree is killed, the registry updated, retention
    /// applied.
    async fn finish(
        &self,
        job: Job,
        tree: &TreeInfo,
        images: &Path,
        mut stats: CheckpointStats,
    ) -> CheckpointOutcome {
        // Also when the survey saw no connection: one accepted before the freeze was locked too.
        let locked = tree.options.tcp_established && tree.options.network_lock == Some(NetworkLock::Nftables);
        if !job.leave_running
            && locked
            && job.reclaim.is_none()
            && let Err(e) = self.shared.left_locks.record(images)
        {
            warn!(checkpoint = %job.id, error = %e, "cannot record the eviction's network lock; it stays");
        }
        if !job.leave_running {
            self.deps.host.signal(&self.tree_now(tree), Signal::SIGKILL);
            // Dead is enough: a root whose parent (a shell, say) reaps it late stays a zombie.
            let left = self.deps.reaper.wait_dead(&tree.pids, KILL_WAIT).await;
            if left.is_empty() {
                self.release_cgroup(&job.workload);
            } else {
                warn!(checkpoint = %job.id, pids = ?left, "evicted processes still present (not our children?)");
            }
        }
        crash_record::HeldTree::clear(&self.deps.state.held_dir(), &job.id);
        stats.total_ms = ms(job.started.elapsed());
        self.remember_checkpoint(&job.workload, job.pid, tree, &job.id, &stats);
        info!(checkpoint = %job.id, workload = %job.workload, ?stats, "checkpoint stored");
        self.apply_retention().await;
        job.outcome(true, stats)
    }

    /// The processes of `tree` now: those inspected that are still the same processes, and
    /// the children they forked since. The upload may have taken minutes: a pid whose process
    /// went meanwhile (killed by someone else) may name another process now, which is not the
    /// tree's to stop, continue or kill.
    fn tree_now(&self, tree: &TreeInfo) -> Vec<i32> {
        let same: Vec<i32> = tree
            .pids
            .iter()
            .copied()
            .filter(|&pid| tree.started.get(&pid).is_none_or(|&t| self.deps.host.start_time(pid) == Some(t)))
            .collect();
        self.deps.host.trees(&same)
    }

    fn remember_checkpoint(
        &self,
        workload: &str,
        pid: i32,
        tree: &TreeInfo,
        id: &str,
        stats: &CheckpointStats,
    ) {
        let now = now_unix_ms();
        let cost = |previous: Option<CheckpointCost>| CheckpointCost {
            at_unix_ms: now,
            since_previous_ms: previous.map(|p| now.saturating_sub(p.at_unix_ms)),
            bytes_total: stats.bytes_total,
            // Chunks are of one size (but the last of a run): new chunks' share of the bytes.
            bytes_new: (stats.bytes_total as u128 * stats.chunks_new as u128
                / stats.chunks_total.max(1) as u128) as u64,
            dump_ms: stats.dump_ms,
            durable_ms: stats.durable_ms,
        };
        let result = if self.registry.get(workload).is_some() {
            self.registry.update(workload, |w| {
                w.last_checkpoint = Some(id.into());
                w.last_error = None;
                w.last_cost = Some(cost(w.last_cost));
            })
        } else {
            self.registry.put(Workload {
                name: workload.into(),
                pid,
                command: tree.command.clone(),
                owner_uid: owner_of(&tree.uids),
                last_checkpoint: Some(id.into()),
                last_cost: Some(cost(None)),
                ..Default::default()
            })
        };
        if let Err(e) = result {
            warn!(workload, error = %e, "cannot record checkpoint in the workload registry");
        }
    }
}

impl Job {
    /// Tells `on_resumed` and `progress` that the tree runs again (or is held stopped).
    fn resumed(&self, timing: &DumpTiming, on_resumed: OnResumed, progress: &ProgressFn) {
        progress(ProgressUpdate { phase: "resumed", done: 0, total: 0 });
        if let Some(notify) = on_resumed {
            let dump_ms = ms(timing.dump_done - timing.started);
            let stats = CheckpointStats { frozen_ms: timing.frozen_ms, dump_ms, ..Default::default() };
            notify(self.outcome(false, stats));
        }
    }

    /// What the store records of the dump.
    fn dumped<'a>(
        &'a self,
        tree: &'a TreeInfo,
        timing: DumpTiming,
        hold: &'a Hold<'_>,
        gpu_restore_ms: u64,
    ) -> Dumped<'a> {
        let (id, workload, created_unix_ms) = (&self.id, &self.workload, self.created_unix_ms);
        Dumped { id, workload, tree, created_unix_ms, timing, gpu: hold.gpu(), gpu_restore_ms }
    }

    fn outcome(&self, durable: bool, stats: CheckpointStats) -> CheckpointOutcome {
        CheckpointOutcome {
            id: self.id.clone(),
            workload: self.workload.clone(),
            pid: self.pid,
            left_running: self.leave_running,
            durable,
            stats,
        }
    }
}

/// Counts a checkpoint's result in the metrics.
fn record_checkpoint(metrics: &Metrics, done: &Result<CheckpointOutcome, CheckpointError>) {
    metrics.checkpoint_done(match done {
        Ok(o) => Ok(CheckpointSample {
            frozen_ms: o.stats.frozen_ms,
            durable_ms: o.stats.durable_ms,
            gpu_ms: o.stats.gpu_lock_ms + o.stats.gpu_checkpoint_ms + o.stats.gpu_restore_ms,
            bytes_total: o.stats.bytes_total,
            bytes_uploaded: o.stats.bytes_uploaded,
        }),
        Err(CheckpointError::Store { .. }) => Err(Failure::Store),
        Err(_) => Err(Failure::Other),
    });
}
