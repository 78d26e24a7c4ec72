//! The checkpoint job.
//!
//! ```text
//! resolve target -> inspect tree (CRIU options) -> CRIU dump (tree frozen; afterwards left
//! running, or left stopped for eviction) -> upload images -> write manifest (commit)
//!   -> eviction: kill the stopped tree
//! on any failure: the tree is resumed, uploaded data is removed, the error is returned
//! ```

use std::sync::Arc;
use std::time::{Duration, Instant};

use nix::sys::signal::Signal;
use tracing::{info, instrument, warn};

use super::dump::{self, Dump};
use super::gpu::GpuTimes;
use super::ids::{checkpoint_id, now_unix_ms};
use super::inspect::{TreeInfo, inspect};
use super::sockets;
use super::workloads::{Workload, derived_name};
use super::{CheckpointError, Engine, ProgressFn, ProgressUpdate};
use crate::criu::{DumpSpec, LOG_FILE, NetworkLock, TreeOptions};
use crate::linux::proc::{self, ProcStat};
use crate::store::{Manifest, Staged};
use stasis_proto::stasis::v1::{AddressRange, DumpOptions, GpuDevice};

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
    /// Called once the tree is resumed (or stopped, for eviction) and before the checkpoint
    /// is stored, with what is known then; for callers that do not wait until durable.
    pub on_resumed: Option<Box<dyn FnOnce(CheckpointOutcome) + Send>>,
}

impl std::fmt::Debug for CheckpointParams {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("CheckpointParams")
            .field("target", &self.target)
            .field("leave_running", &self.leave_running)
            .field("on_resumed", &self.on_resumed.is_some())
            .finish()
    }
}

/// Timings and sizes of one checkpoint (the API's message: plain data).
pub use stasis_proto::stasis::v1::CheckpointStats;

#[derive(Debug, Clone, PartialEq, Eq)]
pub struct CheckpointOutcome {
    pub id: String,
    pub workload: String,
    pub pid: i32,
    pub left_running: bool,
    /// Whether the checkpoint is stored (false only in an early answer, see `on_resumed`).
    pub durable: bool,
    pub stats: CheckpointStats,
}

/// A tree CRIU has dumped, about to be stored as checkpoint `id`.
struct Dumped<'a> {
    id: &'a str,
    workload: &'a str,
    tree: &'a TreeInfo,
    created_unix_ms: u64,
    timing: DumpTiming,
    staged: Staged,
    gpu_pids: &'a [i32],
    gpu_devices: Vec<GpuDevice>,
    gpu_times: GpuTimes,
    gpu_bytes: u64,
    gpu_host_memory: Vec<AddressRange>,
}

/// When the dump started and ended, and how long CRIU kept the tree frozen.
struct DumpTiming {
    started: Instant,
    dump_done: Instant,
    frozen_ms: u64,
}

/// How long an evicted tree may take to disappear after SIGKILL.
const KILL_WAIT: Duration = Duration::from_secs(5);

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
        let job = self.jobs.spawn(async move { this.checkpoint_job(params, progress).await });
        job.await.map_err(|e| CheckpointError::Local { what: "job", source: std::io::Error::other(e) })?
    }

    fn resolve_target(&self, target: &Target) -> Result<(String, i32), CheckpointError> {
        match target {
            Target::Pid(pid) => {
                if !proc::is_running(*pid) {
                    return Err(CheckpointError::NoSuchProcess(*pid));
                }
                let name = match self.registry.by_pid(*pid) {
                    Some(w) => w.name,
                    None => {
                        let program = proc::cmdline(*pid).ok().and_then(|c| c.into_iter().next());
                        derived_name(&program.unwrap_or_default(), &pid.to_string())
                    }
                };
                Ok((name, *pid))
            }
            Target::Workload(name) => {
                let w =
                    self.registry.get(name).ok_or_else(|| CheckpointError::UnknownWorkload(name.clone()))?;
                if !proc::is_running(w.pid) {
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
        if !proc::is_running(pid) {
            return Err(CheckpointError::NoSuchProcess(pid));
        }
        let mut tree = inspect(pid).map_err(|source| CheckpointError::Inspect { pid, source })?;
        if let Some(reason) = tree.sockets.refusal(&self.network_sockets, &self.network_lock) {
            return Err(CheckpointError::Sockets { workload, reason });
        }
        if tree.options.tcp_established {
            tree.options.network_lock = self.network_lock.as_ref().ok().copied();
        }
        let created_unix_ms = now_unix_ms();
        let id = checkpoint_id(created_unix_ms);
        let local = |what| move |source| CheckpointError::Local { what, source };
        let work = self.state.new_work_dir(&id).map_err(local("work directory"))?;
        let stopped_before: Vec<i32> =
            tree.pids.iter().copied().filter(|p| ProcStat::read(*p).is_ok_and(|s| s.is_stopped())).collect();
        info!(checkpoint = %id, workload = %workload, pid, pids = tree.pids.len(), options = ?tree.options.describe(), "dumping");

        let suspended = self.suspend_gpu(&tree.pids, &progress).await?;
        progress(ProgressUpdate { phase: "dump", done: 0, total: 0 });
        let spec = DumpSpec {
            pid,
            images_dir: work.path().to_path_buf(),
            tree: tree.options.clone(),
            leave_running: params.leave_running,
            leave_stopped: !params.leave_running,
            page_server_fd: None,
        };
        let (criu, version, limit) = (self.criu.clone(), self.criu_version, self.staging_limit);
        let dumped = tokio::task::spawn_blocking(move || dump::dump(&criu, version, spec, limit))
            .await
            .map_err(|e| local("dump thread")(std::io::Error::other(e)))?;
        let dump_done = Instant::now();
        let Dump { frozen_at, staged } = match dumped {
            Ok(dump) => dump,
            Err(failure) => {
                // A CRIU failure was rolled back by CRIU; one after CRIU finished was not.
                let undo = Undo { tree: &tree, stopped_before: &stopped_before, images: work.path() };
                let criu_done = !matches!(failure, dump::DumpFailure::Criu(_));
                let problems = self.give_back(undo, criu_done && !params.leave_running, &suspended).await;
                return Err(CheckpointError::with_rollback(failure.into_error(workload), problems));
            }
        };
        let gpu_restore_ms = if params.leave_running { self.resume_gpu(&suspended).await? } else { 0 };
        progress(ProgressUpdate { phase: "resumed", done: 0, total: 0 });
        if let Some(notify) = params.on_resumed {
            let frozen_ms = frozen_at.map(|t| ms(dump_done - t)).unwrap_or_default();
            notify(CheckpointOutcome {
                id: id.clone(),
                workload: workload.clone(),
                pid,
                left_running: params.leave_running,
                durable: false,
                stats: CheckpointStats { frozen_ms, dump_ms: ms(dump_done - started), ..Default::default() },
            });
        }

        let timing = DumpTiming {
            started,
            dump_done,
            frozen_ms: frozen_at.map(|t| ms(dump_done - t)).unwrap_or_else(|| ms(dump_done - started)),
        };
        let gpu_pids = suspended.as_ref().map(|s| s.pids.clone()).unwrap_or_default();
        let gpu_devices = suspended.as_ref().map(|s| s.devices.clone()).unwrap_or_default();
        let gpu_bytes = suspended.as_ref().map(|s| s.bytes).unwrap_or_default();
        let gpu_host_memory = suspended.as_ref().map(|s| s.host_memory.clone()).unwrap_or_default();
        let gpu_times = GpuTimes {
            restore_ms: gpu_restore_ms,
            ..suspended.as_ref().map(|s| s.times).unwrap_or_default()
        };
        let dumped = Dumped {
            id: &id,
            workload: &workload,
            tree: &tree,
            created_unix_ms,
            timing,
            staged,
            gpu_pids: &gpu_pids,
            gpu_devices,
            gpu_times,
            gpu_bytes,
            gpu_host_memory,
        };
        let stored = self.store_checkpoint(dumped, work.path(), &progress).await;
        let mut stats = match stored {
            Ok(stats) => stats,
            Err(e) if params.leave_running => return Err(e),
            Err(e) => {
                let undo = Undo { tree: &tree, stopped_before: &stopped_before, images: work.path() };
                let problems = self.give_back(undo, true, &suspended).await;
                return Err(CheckpointError::with_rollback(e, problems));
            }
        };

        if !params.leave_running {
            proc::signal_all(&tree.pids, Signal::SIGKILL);
            let left = self.reaper.wait_gone(&tree.pids, KILL_WAIT).await;
            if left.is_empty() {
                self.release_cgroup(&workload);
            } else {
                warn!(checkpoint = %id, pids = ?left, "evicted processes still present (not our children?)");
            }
        }
        stats.total_ms = ms(started.elapsed());
        self.remember_checkpoint(&workload, pid, &tree, &id);
        info!(checkpoint = %id, workload = %workload, ?stats, "checkpoint stored");
        self.apply_retention().await;
        Ok(CheckpointOutcome { id, workload, pid, left_running: params.leave_running, durable: true, stats })
    }

    /// Stores the dump's chunks and commits the manifest. Packs of a failed attempt stay
    /// unreferenced until garbage collection (another checkpoint may already share them).
    async fn store_checkpoint(
        &self,
        dumped: Dumped<'_>,
        images: &std::path::Path,
        progress: &ProgressFn,
    ) -> Result<CheckpointStats, CheckpointError> {
        let Dumped {
            id,
            workload,
            tree,
            created_unix_ms,
            timing,
            staged,
            gpu_pids,
            gpu_devices,
            gpu_times,
            gpu_bytes,
            gpu_host_memory,
        } = dumped;
        let store_err = |source| CheckpointError::Store { id: id.into(), source: Box::new(source) };
        self.state
            .mark_inflight(id)
            .map_err(|source| CheckpointError::Local { what: "in-flight marker", source })?;
        let report: crate::store::Progress = {
            let progress = progress.clone();
            Arc::new(move |done, total| progress(ProgressUpdate { phase: "upload", done, total }))
        };
        let guard = self.store.begin_commit().await;
        let stored = self
            .store
            .store_dump(Arc::new(staged), images, &[LOG_FILE, dump::SPILL_FILE], report)
            .await
            .map_err(store_err)?;
        let stats = CheckpointStats {
            frozen_ms: timing.frozen_ms,
            total_ms: ms(timing.started.elapsed()),
            durable_ms: ms(timing.started.elapsed()),
            bytes_total: stored.chunks.bytes_total,
            bytes_uploaded: stored.bytes_uploaded,
            chunks_total: stored.chunks.chunks_total,
            chunks_new: stored.chunks.chunks_new,
            chunks_zero: stored.chunks.chunks_zero,
            gpu_lock_ms: gpu_times.lock_ms,
            gpu_checkpoint_ms: gpu_times.checkpoint_ms,
            gpu_restore_ms: gpu_times.restore_ms,
            gpu_bytes,
            dump_ms: ms(timing.dump_done - timing.started),
            store_ms: ms(timing.dump_done.elapsed()),
        };
        let manifest = Manifest {
            id: id.into(),
            workload: workload.into(),
            created_unix_ms,
            node: proc::node_name(),
            kernel: proc::kernel_release(),
            criu_version: self.criu_version.to_string(),
            root_pid: tree.pids[0],
            pids: tree.pids.clone(),
            command: tree.command.clone(),
            options: Some(dump_options(&tree.options)),
            parent_id: self.registry.get(workload).and_then(|w| w.last_checkpoint).unwrap_or_default(),
            files: stored.files,
            memory: stored.memory,
            gpu_pids: gpu_pids.to_vec(),
            gpus: gpu_devices,
            gpu_host_memory,
            cuda_driver: self.gpu.as_ref().map(|g| g.driver_version()).unwrap_or_default(),
            stats: Some(stats),
            sockets: tree.sockets.records.clone(),
        };
        self.store.commit(&manifest, &guard).await.map_err(store_err)?;
        drop(guard);
        self.state.clear_inflight(id);
        Ok(stats)
    }

    /// Resumes a tree a failed checkpoint stopped: its connections first when CRIU left them
    /// locked (`reopen`), then its processes, then its CUDA state. Returns what could not be
    /// undone.
    async fn give_back(
        &self,
        undo: Undo<'_>,
        reopen: bool,
        suspended: &Option<super::gpu::Suspended>,
    ) -> Vec<String> {
        let mut problems = Vec::new();
        if reopen {
            let (pids, reuse) = (undo.tree.pids.clone(), undo.tree.sockets.reuse_addr.clone());
            let repaired = tokio::task::spawn_blocking(move || sockets::leave_repair(&pids, &reuse)).await;
            let (reopened, left) = repaired
                .unwrap_or_else(|e| (Vec::new(), vec![format!("the connection rollback failed: {e}")]));
            problems.extend(left);
            let lock = undo.tree.options.network_lock;
            problems.extend(sockets::unlock(&reopened, undo.images, lock, &self.reaper).await);
        }
        resume(&undo.tree.pids, undo.stopped_before);
        if let Err(e) = self.resume_gpu(suspended).await {
            problems.push(crate::error_chain(&e));
        }
        for problem in &problems {
            warn!(problem = %problem, "rollback incomplete");
        }
        problems
    }

    fn remember_checkpoint(&self, workload: &str, pid: i32, tree: &TreeInfo, id: &str) {
        let result = if self.registry.get(workload).is_some() {
            self.registry.update(workload, |w| w.last_checkpoint = Some(id.into()))
        } else {
            self.registry.put(Workload {
                name: workload.into(),
                pid,
                command: tree.command.clone(),
                managed: false,
                log_path: None,
                cgroup: None,
                last_checkpoint: Some(id.into()),
            })
        };
        if let Err(e) = result {
            warn!(workload, error = %e, "cannot record checkpoint in the workload registry");
        }
    }
}

/// What a failed checkpoint must undo: the tree, which of its processes were stopped before
/// (they stay stopped), and the dump's images (naming CRIU's network lock).
struct Undo<'a> {
    tree: &'a TreeInfo,
    stopped_before: &'a [i32],
    images: &'a std::path::Path,
}

/// Continues every process of `pids` that is stopped now but was not before the dump.
fn resume(pids: &[i32], stopped_before: &[i32]) {
    for &pid in pids.iter().filter(|p| !stopped_before.contains(p)) {
        if ProcStat::read(pid).is_ok_and(|s| s.is_stopped()) {
            proc::signal_all(&[pid], Signal::SIGCONT);
        }
    }
}

fn ms(d: Duration) -> u64 {
    d.as_millis() as u64
}

pub(super) fn dump_options(t: &TreeOptions) -> DumpOptions {
    DumpOptions {
        shell_job: t.shell_job,
        tcp_established: t.tcp_established,
        ext_unix_sk: t.ext_unix_sk,
        file_locks: t.file_locks,
        external: t.external.clone(),
        link_remap: t.link_remap,
        network_lock: t.network_lock.map(|l| l.name().to_string()).unwrap_or_default(),
    }
}

pub(super) fn tree_options(d: &DumpOptions) -> TreeOptions {
    TreeOptions {
        shell_job: d.shell_job,
        tcp_established: d.tcp_established,
        ext_unix_sk: d.ext_unix_sk,
        file_locks: d.file_locks,
        external: d.external.clone(),
        link_remap: d.link_remap,
        network_lock: NetworkLock::from_name(&d.network_lock),
    }
}
