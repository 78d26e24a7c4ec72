//! The restore job: fetch and verify the checkpoint, then let CRIU recreate the tree.
//!
//! ```text
//! manifest (verified) -> process ids free? -> download images (size + BLAKE3 checked)
//!   -> CRIU restore (the root becomes stasisd's child) -> workload registry updated
//! ```
//! CRIU kills a tree it could not restore completely, so a failed restore leaves nothing
//! running.

use std::sync::Arc;
use std::time::{Duration, Instant};

use tracing::{info, instrument, warn};

use super::checkpoint::tree_options;
use super::gpu::{self, GpuError};
use super::gpu_map;
use super::ids::valid_checkpoint_id;
use super::workloads::Workload;
use super::{Engine, ProgressFn, ProgressUpdate, RestoreError};
use crate::cuda::GpuUuid;
use std::os::fd::OwnedFd;

use super::lazy::{FaultGuard, LazySession};
use super::sockets;
use crate::criu::RestoreSpec;
use crate::linux::pty;
use crate::store::{Manifest, MemoryMode};

#[derive(Debug, Clone, PartialEq, Eq)]
pub enum RestoreTarget {
    Checkpoint(String),
    /// The latest checkpoint of this workload.
    Workload(String),
}

pub struct RestoreParams {
    pub target: RestoreTarget,
    /// GPUs to move the checkpoint's GPU state to: (checkpoint GPU, this node's GPU).
    pub gpu_map: Vec<(GpuUuid, GpuUuid)>,
    /// Run the tree before its memory is local (see `engine/lazy.rs`).
    pub lazy: bool,
    /// Restore established TCP connections closed (their local addresses may not be here).
    pub tcp_close: bool,
    /// Called once a lazily restored tree runs, before its memory is all in; for callers
    /// that do not wait until it is.
    pub on_running: Option<Box<dyn FnOnce(RestoreOutcome) + Send>>,
}

impl std::fmt::Debug for RestoreParams {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("RestoreParams")
            .field("target", &self.target)
            .field("gpu_map", &self.gpu_map)
            .field("lazy", &self.lazy)
            .field("tcp_close", &self.tcp_close)
            .field("on_running", &self.on_running.is_some())
            .finish()
    }
}

#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct RestoreStats {
    /// From request until the tree runs.
    pub restore_ms: u64,
    pub fetch_ms: u64,
    pub criu_ms: u64,
    pub bytes_fetched: u64,
    pub gpu_restore_ms: u64,
    /// From request until the tree runs.
    pub first_run_ms: u64,
    /// From request until every page is resident.
    pub resident_ms: u64,
    pub lazy: bool,
}

#[derive(Debug, Clone, PartialEq, Eq)]
pub struct RestoreOutcome {
    pub id: String,
    pub workload: String,
    pub pid: i32,
    pub stats: RestoreStats,
    /// What the restored tree will notice (a connection whose peer is gone, ...).
    pub warnings: Vec<String>,
}

/// How long to wait for the checkpointed tree's old processes to be reaped.
const PIDS_FREE_WAIT: Duration = Duration::from_secs(3);

impl Engine {
    /// Restores a checkpoint, as a job that finishes even if the caller goes away.
    pub async fn restore(
        self: &Arc<Self>,
        params: RestoreParams,
        progress: ProgressFn,
    ) -> Result<RestoreOutcome, RestoreError> {
        if self.jobs.is_closed() {
            return Err(RestoreError::ShuttingDown);
        }
        let this = self.clone();
        let job = self.jobs.spawn(async move { this.restore_job(params, progress).await });
        job.await.map_err(|e| RestoreError::Local { what: "job", source: std::io::Error::other(e) })?
    }

    async fn find_manifest(&self, target: &RestoreTarget) -> Result<Manifest, RestoreError> {
        match target {
            RestoreTarget::Checkpoint(id) if !valid_checkpoint_id(id) => Err(RestoreError::BadId(id.clone())),
            RestoreTarget::Checkpoint(id) => Ok(self.store.manifest(id).await?),
            RestoreTarget::Workload(name) => self
                .store
                .manifests()
                .await?
                .into_iter()
                .filter(|m| &m.workload == name)
                .max_by(|a, b| (a.created_unix_ms, &a.id).cmp(&(b.created_unix_ms, &b.id)))
                .ok_or_else(|| RestoreError::NoCheckpoints(name.clone())),
        }
    }

    #[instrument(skip_all, fields(target = ?params.target))]
    async fn restore_job(
        &self,
        params: RestoreParams,
        progress: ProgressFn,
    ) -> Result<RestoreOutcome, RestoreError> {
        let started = Instant::now();
        let manifest = self.find_manifest(&params.target).await?;
        let id = manifest.id.clone();
        let _guard = self.lock_workload(&manifest.workload).await;
        let busy = self.reaper.wait_gone(&manifest.pids, PIDS_FREE_WAIT).await;
        if !busy.is_empty() {
            return Err(RestoreError::PidsInUse { id, pids: busy });
        }
        let warnings = sockets::check_restore(&manifest.sockets, params.tcp_close)
            .map_err(|reason| RestoreError::Sockets { id: id.clone(), reason })?;
        for warning in &warnings {
            warn!(checkpoint = %id, "{warning}");
        }
        let gpu_pairs = self.place_gpus(&manifest, &params.gpu_map)?;
        let local = |what| move |source| RestoreError::Local { what, source };
        let bytes = manifest.stats.map(|s| s.bytes_total).unwrap_or_default();
        let work = self.state.new_restore_dir(bytes).map_err(local("restore scratch directory"))?;

        let report: crate::store::Progress = {
            let progress = progress.clone();
            Arc::new(move |done, total| progress(ProgressUpdate { phase: "download", done, total }))
        };
        // Packs stay out of garbage collection's reach until every page is in.
        let guard = self.store.begin_commit().await;
        let mode = match params.lazy {
            true => MemoryMode::Lazy { eager: &manifest.gpu_host_memory },
            false => MemoryMode::Eager,
        };
        let (bytes_fetched, memory) = self.store.materialize_as(&manifest, work.path(), mode, report).await?;
        let fetched = Instant::now();
        let tree = tree_options(&manifest.options.clone().unwrap_or_default());
        let inherit_fds =
            self.replacement_terminals(&manifest.workload, &tree.external).map_err(local("terminal"))?;
        let session = match memory.is_empty() {
            true => None,
            false => Some(
                self.start_lazy(&manifest, work.path(), memory)
                    .await
                    .map_err(|source| RestoreError::LazyStart { id: id.clone(), source })?,
            ),
        };

        progress(ProgressUpdate { phase: "restore", done: 0, total: 0 });
        let images_dir = work.path().to_path_buf();
        let spec = RestoreSpec {
            images_dir,
            tree,
            inherit_fds,
            lazy_pages: session.is_some(),
            tcp_close: params.tcp_close,
        };
        session.iter().for_each(LazySession::arm);
        let criu = self.criu.clone();
        let faults = session.as_ref().map(LazySession::fault_guard);
        let on_notify = {
            let faults = faults.clone();
            move |script: &str| match faults.as_ref().filter(|_| script == "pre-resume") {
                Some(faults) => faults.start(),
                None => Ok(()),
            }
        };
        let restored = tokio::task::spawn_blocking(move || criu.restore(&spec, on_notify))
            .await
            .map_err(|e| local("restore thread")(std::io::Error::other(e)))
            .and_then(|r| r.map_err(|source| RestoreError::Criu { id: id.clone(), source }));
        let pid = match restored {
            Ok(pid) => pid,
            Err(e) => {
                if let Some(session) = session {
                    session.abort();
                }
                return Err(e);
            }
        };
        if let Some(reason) = faults.as_ref().and_then(FaultGuard::not_started) {
            // CRIU only logs a failed notification and lets the tree run: stop it.
            super::lazy::kill_tree(&manifest.pids);
            if let Some(session) = session {
                session.abort();
            }
            let source = super::lazy::LazyError::Guard(reason);
            return Err(RestoreError::Lazy { id, pid, source });
        }
        let watch = session.map(|s| s.watch(self.reaper.clone(), manifest.clone(), progress.clone()));
        // On failure this kills the tree; the lazy session then ends by itself.
        let gpu_restore_ms = self.reattach_gpu(&manifest, gpu_pairs, &progress).await?;
        let first_run_ms = started.elapsed().as_millis() as u64;
        let mut stats = RestoreStats {
            restore_ms: first_run_ms,
            fetch_ms: (fetched - started).as_millis() as u64,
            criu_ms: fetched.elapsed().as_millis() as u64,
            bytes_fetched,
            gpu_restore_ms,
            first_run_ms,
            resident_ms: first_run_ms,
            lazy: params.lazy,
        };
        self.remember_restore(&manifest, pid).map_err(local("workload registry update"))?;
        let outcome = |stats| RestoreOutcome {
            id: id.clone(),
            workload: manifest.workload.clone(),
            pid,
            stats,
            warnings: warnings.clone(),
        };
        if let Some(watch) = watch {
            info!(checkpoint = %id, pid, first_run_ms, "lazily restored tree runs");
            if let Some(notify) = params.on_running {
                notify(outcome(stats.clone()));
            }
            let watched = watch.await.map_err(|e| local("lazy restore task")(std::io::Error::other(e)))?;
            let (lazy_bytes, resident_at) =
                watched.map_err(|source| RestoreError::Lazy { id: id.clone(), pid, source })?;
            stats.bytes_fetched += lazy_bytes;
            stats.resident_ms = (resident_at - started).as_millis() as u64;
        }
        drop(guard);
        info!(checkpoint = %id, workload = %manifest.workload, pid, ?stats, "restored");
        Ok(outcome(stats))
    }

    /// Puts the device memory of the restored CUDA processes back and unlocks them. On failure
    /// the restored tree is killed: a job without its GPU state must not run on.
    async fn reattach_gpu(
        &self,
        manifest: &Manifest,
        pairs: Vec<(GpuUuid, GpuUuid)>,
        progress: &ProgressFn,
    ) -> Result<u64, RestoreError> {
        if manifest.gpu_pids.is_empty() {
            return Ok(0);
        }
        let id = manifest.id.clone();
        let kill = |pids: &[i32]| crate::linux::proc::signal_all(pids, nix::sys::signal::Signal::SIGKILL);
        let Some(gpu) = self.gpu.clone() else {
            kill(&manifest.pids);
            return Err(RestoreError::Gpu { id, source: GpuError::NoDriver(manifest.gpu_pids.clone()) });
        };
        progress(ProgressUpdate { phase: "gpu restore", done: 0, total: 0 });
        let pids = manifest.gpu_pids.clone();
        let result = tokio::task::spawn_blocking(move || gpu::reattach(&gpu, &pids, &pairs))
            .await
            .map_err(|e| RestoreError::Local { what: "GPU thread", source: std::io::Error::other(e) })?;
        result.map_err(|source| {
            kill(&manifest.pids);
            RestoreError::Gpu { id, source }
        })
    }

    /// Where the checkpoint's GPU state goes on this node; refuses an incompatible node
    /// before anything is restored.
    fn place_gpus(
        &self,
        manifest: &Manifest,
        explicit: &[(GpuUuid, GpuUuid)],
    ) -> Result<Vec<(GpuUuid, GpuUuid)>, RestoreError> {
        if manifest.gpu_pids.is_empty() {
            return Ok(Vec::new());
        }
        let id = manifest.id.clone();
        let gpu = self.gpu.as_ref().ok_or_else(|| RestoreError::Gpu {
            id: id.clone(),
            source: GpuError::NoDriver(manifest.gpu_pids.clone()),
        })?;
        let present =
            gpu.gpus().map_err(|e| RestoreError::Gpu { id: id.clone(), source: GpuError::Query(e) })?;
        gpu_map::plan(&manifest.gpus, &present, explicit)
            .map_err(|source| RestoreError::GpuPlacement { id, source: Box::new(source) })
    }

    /// A new terminal, logged to the workload's log, for each terminal the tree had.
    fn replacement_terminals(
        &self,
        workload: &str,
        external: &[String],
    ) -> std::io::Result<Vec<(String, OwnedFd)>> {
        let log = self
            .registry
            .get(workload)
            .and_then(|w| w.log_path)
            .unwrap_or_else(|| self.state.log_file(workload));
        external
            .iter()
            .filter(|k| pty::is_tty_key(k))
            .map(|key| Ok((key.clone(), pty::terminal_to_log(&log)?)))
            .collect()
    }

    fn remember_restore(&self, manifest: &Manifest, pid: i32) -> std::io::Result<()> {
        if self.registry.get(&manifest.workload).is_some() {
            return self.registry.update(&manifest.workload, |w| w.pid = pid);
        }
        self.registry.put(Workload {
            name: manifest.workload.clone(),
            pid,
            command: manifest.command.clone(),
            managed: false,
            log_path: Some(self.state.log_file(&manifest.workload)),
            cgroup: None,
            last_checkpoint: Some(manifest.id.clone()),
        })
    }
}
