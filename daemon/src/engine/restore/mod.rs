//! The restore job: fetch and verify the checkpoint, then let CRIU recreate the tree.
//!
//! ```text
//! manifest (verified) -> preflight: pids free, ports and addresses, GPUs placed
//!   -> download images (size + BLAKE3 checked; a lazy restore leaves memory in the store)
//!   -> CRIU restore (the root becomes stasisd's child) -> GPU state back -> registry updated
//!   -> lazy: wait until every page is resident
//! ```
//! `preflight.rs` checks the node, `criu.rs` fetches the images and runs CRIU, `identity.rs`
//! names the restored tree and records it; this file runs the job and puts GPU state back.
//!
//! Nothing partly restored is left running: CRIU kills a tree it could not restore, and a
//! failure after CRIU's restore kills the tree ([`Restored`], and the lazy session).

mod criu;
mod identity;
mod preflight;

use std::sync::Arc;
use std::time::Instant;

use tracing::{info, instrument, warn};

use super::gpu::{self, GpuError};
use super::hot_restore::{KillTree, LazyError, Roots, tree_killer};
use super::ids::{ms, valid_checkpoint_id};
use super::pods::{self, ContainerRef};
use super::{Caller, Engine, ProgressFn, ProgressUpdate, RestoreError, lock};
use crate::cuda::GpuUuid;
use crate::metrics::{Failure, Metrics, RestoreSample};
use crate::store::Manifest;
use criu::Placement;

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
    /// Run the tree before its memory is local (see `engine/hot_restore/`).
    pub lazy: bool,
    /// Restore established TCP connections closed (their local addresses may not be here).
    pub tcp_close: bool,
    /// Called once a lazily restored tree runs, before its memory is all in; for callers
    /// that do not wait until it is.
    pub on_running: Option<Box<dyn FnOnce(RestoreOutcome) + Send>>,
    /// On whose behalf: a user other than root may restore only its own checkpoints.
    pub caller: Caller,
    /// Restore as a workload of this name (a second copy of one running, from a checkpoint of
    /// a tree with its own pid namespace), not under the checkpoint's own.
    pub as_workload: Option<String>,
    /// Restore into this Kubernetes container, as its init's child (see `pods/`).
    pub into: Option<ContainerRef>,
}

impl std::fmt::Debug for RestoreParams {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("RestoreParams")
            .field("target", &self.target)
            .field("gpu_map", &self.gpu_map)
            .field("lazy", &self.lazy)
            .field("tcp_close", &self.tcp_close)
            .field("on_running", &self.on_running.is_some())
            .field("as_workload", &self.as_workload)
            .field("into", &self.into)
            .field("caller", &self.caller)
            .finish()
    }
}

#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct RestoreStats {
    /// From request until the tree runs (the same as `first_run_ms`; the API's older name).
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

impl RestoreStats {
    /// The stats of a tree that runs now, its images fetched at `fetched`.
    fn running(
        started: Instant,
        fetched: Instant,
        bytes_fetched: u64,
        gpu_restore_ms: u64,
        lazy: bool,
    ) -> Self {
        let first_run_ms = ms(started.elapsed());
        RestoreStats {
            restore_ms: first_run_ms,
            fetch_ms: ms(fetched - started),
            criu_ms: ms(fetched.elapsed()),
            bytes_fetched,
            gpu_restore_ms,
            first_run_ms,
            resident_ms: first_run_ms,
            lazy,
        }
    }
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
        let job = async move { this.restore_job(params, progress).await };
        let joined = self.tracked("restore", job, record_restore).await;
        joined.map_err(RestoreError::panicked("restore job"))?
    }

    pub(super) async fn find_manifest(&self, target: &RestoreTarget) -> Result<Manifest, RestoreError> {
        match target {
            RestoreTarget::Checkpoint(id) if !valid_checkpoint_id(id) => Err(RestoreError::BadId(id.clone())),
            RestoreTarget::Checkpoint(id) => Ok(self.deps.store.manifest(id).await?),
            RestoreTarget::Workload(name) => self
                .deps
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
        if !params.caller.owns(manifest.owner_uid) {
            return Err(RestoreError::NotYours(manifest.id));
        }
        let name = params.as_workload.clone().unwrap_or_else(|| manifest.workload.clone());
        if let Some(archive) = &manifest.archive {
            // The container comes back under its own name (an import's workload name is
            // `imported.NAME`), unless --as names another.
            let container = match (&params.as_workload, archive.container.is_empty()) {
                (None, false) => archive.container.clone(),
                _ => name,
            };
            return self.restore_container(&manifest, &container).await;
        }
        let _guard = self.lock_workload(&name).await;
        let placement = match params.into.clone() {
            Some(container) => Placement::Container(container),
            None => {
                self.check_name(&manifest, &name, params.caller)?;
                Placement::Home(self.restored_home(&manifest, &name, params.caller)?)
            }
        };
        let preflight =
            self.preflight(&manifest, &params.gpu_map, params.tcp_close, params.into.as_ref()).await?;
        let lazy = params.lazy;
        let bytes = manifest.stats.map(|s| s.bytes_total).unwrap_or_default();
        let work = self
            .deps
            .state
            .new_restore_dir(bytes)
            .map_err(RestoreError::local("restore scratch directory"))?;
        // Packs stay out of garbage collection's reach until every page is in.
        let commit_guard = self.deps.store.begin_commit().await?;
        if let (true, Err(why)) = (lazy, &self.support.served_memory) {
            let source = LazyError::Start(std::io::Error::other(why.clone()));
            return Err(RestoreError::LazyStart { id: manifest.id.clone(), lazy, source });
        }
        let (bytes_fetched, memory) = self.fetch_images(&manifest, work.path(), lazy, &progress).await?;
        (self.deps.host.install_init_programs(work.path()))
            .map_err(RestoreError::local("the checkpoint's stasis-init"))?;
        let fetched = Instant::now();
        let roots = initial_roots(&manifest);
        let session = match memory.is_empty() {
            true => None,
            false => Some(
                self.start_lazy(&manifest, work.path(), memory, roots.clone(), !lazy)
                    .map_err(|source| RestoreError::LazyStart { id: manifest.id.clone(), lazy, source })?,
            ),
        };
        let (pid, session) =
            self.run_criu(&manifest, &placement, work.path(), params.tcp_close, session, &progress).await?;
        // CRIU is done with the tree by now: no CRIU to kill with it.
        let kill = tree_killer(self.deps.host.clone(), roots.clone(), Default::default());
        let mut restored = Restored { kill, armed: true };
        let pid = match &placement {
            // CRIU named the root as the container sees it.
            Placement::Container(c) => pods::adopted(self.deps.host.as_ref(), c, pid)
                .await
                .map_err(RestoreError::local("finding the restored tree"))?,
            Placement::Home(_) => pid,
        };
        if manifest.own_pid_namespace || manifest.pod.is_some() {
            *lock(&roots) = vec![pid];
        }
        let watch = session.map(|s| s.watch(progress.clone()));
        let gpu_pids = self.restored_pids(&manifest, pid, &manifest.gpu_pids);
        let container_init = match &placement {
            Placement::Container(c) => Some(c.init_pid),
            Placement::Home(_) => None,
        };
        let gpu_restore_ms =
            self.reattach_gpu(&manifest, gpu_pids, preflight.gpu_pairs, container_init, &progress).await?;
        restored.armed = false;
        let stats = RestoreStats::running(started, fetched, bytes_fetched, gpu_restore_ms, lazy);
        self.remember_restore(&manifest, &placement, &name, pid);
        let outcome = RestoreOutcome {
            id: manifest.id.clone(),
            workload: name,
            pid,
            stats,
            warnings: preflight.warnings,
        };
        let outcome = match watch {
            Some(watch) => self.wait_resident(outcome, watch, started, lazy, params.on_running).await?,
            None => outcome,
        };
        drop(commit_guard);
        info!(checkpoint = %outcome.id, workload = %outcome.workload, pid, stats = ?outcome.stats, "restored");
        Ok(outcome)
    }

    /// Reports a lazily restored tree running, then waits until its memory is resident (for
    /// an eager restore, it is already: its tree is not reported before its result).
    async fn wait_resident(
        &self,
        mut outcome: RestoreOutcome,
        watch: tokio::task::JoinHandle<Result<(u64, Instant), LazyError>>,
        started: Instant,
        lazy: bool,
        on_running: Option<Box<dyn FnOnce(RestoreOutcome) + Send>>,
    ) -> Result<RestoreOutcome, RestoreError> {
        // An eager restore's tree runs with all of its memory: its result follows at once.
        if lazy {
            info!(checkpoint = %outcome.id, pid = outcome.pid, first_run_ms = outcome.stats.first_run_ms, "lazily restored tree runs");
            if let Some(notify) = on_running {
                notify(outcome.clone());
            }
        }
        let (id, pid) = (outcome.id.clone(), outcome.pid);
        let watched = match watch.await {
            Ok(watched) => watched.map_err(|source| RestoreError::Lazy { id, lazy, pid, source }),
            Err(e) => Err(RestoreError::panicked("memory-serving task")(e)),
        };
        let (lazy_bytes, resident_at) = watched.inspect_err(|e| {
            // The tree is gone: whoever looks at the workload next learns why.
            let why = crate::error_chain(e);
            if let Err(e) = self.registry.update(&outcome.workload, |w| w.last_error = Some(why)) {
                warn!(workload = %outcome.workload, error = %e, "cannot record the failure in the registry");
            }
        })?;
        outcome.stats.bytes_fetched += lazy_bytes;
        outcome.stats.resident_ms = ms(resident_at - started).max(outcome.stats.first_run_ms);
        Ok(outcome)
    }

    /// Puts the device memory of the restored CUDA processes (`pids`, as restored, in the
    /// container whose init is `container_init` if any) back and unlocks them. On failure
    /// the caller's [`Restored`] kills the tree: a job without its GPU state must not run on.
    async fn reattach_gpu(
        &self,
        manifest: &Manifest,
        pids: Vec<i32>,
        pairs: Vec<(GpuUuid, GpuUuid)>,
        container_init: Option<i32>,
        progress: &ProgressFn,
    ) -> Result<u64, RestoreError> {
        if manifest.gpu_pids.is_empty() {
            return Ok(0);
        }
        let id = manifest.id.clone();
        if pids.len() != manifest.gpu_pids.len() {
            let source = GpuError::Missing { found: pids.len(), recorded: manifest.gpu_pids.len() };
            return Err(RestoreError::Gpu { id, source });
        }
        let Some(gpu) = self.gpu_for(container_init) else {
            return Err(RestoreError::Gpu { id, source: GpuError::NoDriver(manifest.gpu_pids.clone()) });
        };
        progress(ProgressUpdate { phase: "gpu restore", done: 0, total: 0 });
        let result = tokio::task::spawn_blocking(move || gpu::reattach(&gpu, &pids, &pairs))
            .await
            .map_err(RestoreError::panicked("GPU thread"))?;
        result.map_err(|source| RestoreError::Gpu { id, source })
    }
}

/// The restored tree's roots as known before CRIU runs: the recorded pids, or none yet for a
/// tree with its own pid namespace or restored into a container (its root is known once CRIU
/// created it).
fn initial_roots(manifest: &Manifest) -> Roots {
    let renumbered = manifest.own_pid_namespace || manifest.pod.is_some();
    let known = if renumbered { Vec::new() } else { manifest.pids.clone() };
    Arc::new(std::sync::Mutex::new(known))
}

/// A tree CRIU restored: killed (with whatever it started) when dropped armed, so that no
/// exit of the job between CRIU's restore and its end leaves a partly restored tree running.
struct Restored {
    kill: KillTree,
    armed: bool,
}

impl Drop for Restored {
    fn drop(&mut self) {
        if self.armed {
            (self.kill)();
        }
    }
}

/// Counts a restore's result in the metrics.
fn record_restore(metrics: &Metrics, done: &Result<RestoreOutcome, RestoreError>) {
    metrics.restore_done(match done {
        Ok(o) => Ok(RestoreSample { first_run_ms: o.stats.first_run_ms, resident_ms: o.stats.resident_ms }),
        Err(RestoreError::Store(_)) => Err(Failure::Store),
        Err(_) => Err(Failure::Other),
    });
}
