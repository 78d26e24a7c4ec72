//! The engine: stasis's typed domain API. The gRPC layer only converts types and calls it.
//!
//! Long operations (checkpoint, restore) run as jobs tracked by [`Engine::jobs`], so a
//! shutting-down daemon can wait for them: a job that has started always finishes or rolls
//! back, also when its client goes away.

mod checkpoint;
mod dump;
mod error;
mod gpu;
mod gpu_map;
mod ids;
mod inspect;
mod lazy;
mod query;
mod restore;
mod run;
mod sockets;
mod state;
mod workloads;

use std::collections::HashMap;
use std::path::PathBuf;
use std::sync::Arc;

pub use checkpoint::{CheckpointOutcome, CheckpointParams, CheckpointStats, Target};
pub use error::{CheckpointError, QueryError, RestoreError, RunError, StartError};
pub use ids::{now_unix_ms, valid_checkpoint_id};
pub use lazy::LazyError;
pub use query::{CheckpointSummary, StatusReport};
pub use restore::{RestoreOutcome, RestoreParams, RestoreStats, RestoreTarget};
pub use run::{RunOutcome, RunParams};
use tokio_util::task::TaskTracker;
use tracing::{info, warn};
pub use workloads::Workload;

use crate::criu::{Criu, CriuVersion, MIN_VERSION, NetworkLock, support};
use crate::cuda::{CudaDriver, CudaError, GpuCheckpointer};
use crate::linux::cgroup::WorkloadCgroup;
use crate::linux::reaper::Reaper;
use crate::store::Store;
use state::StateDir;
use workloads::Registry;

/// What the engine needs to start.
#[derive(Debug, Clone)]
pub struct EngineConfig {
    pub state_dir: PathBuf,
    pub store_url: String,
    pub criu_path: PathBuf,
    /// Bytes of dumped pages held in memory before spilling to disk (default: RAM / 4).
    pub staging_limit: Option<u64>,
    /// Checkpoints kept per workload by the retention policy; `None` keeps all.
    pub keep_last: Option<usize>,
    /// Unreferenced packs younger than this are left alone: another node may be uploading
    /// the checkpoint that will reference them.
    pub gc_grace: std::time::Duration,
    /// How long requests to a remote store are retried before they fail.
    pub store_retry: std::time::Duration,
    /// How lazy restores fetch memory.
    pub lazy: crate::store::FetchSettings,
    /// The network lock to use; `None` picks one (see [`support::choose_network_lock`]).
    pub network_lock: Option<NetworkLock>,
}

/// A progress report of a long operation.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct ProgressUpdate {
    pub phase: &'static str,
    pub done: u64,
    pub total: u64,
}

/// Receives progress reports; must be cheap and never block.
pub type ProgressFn = Arc<dyn Fn(ProgressUpdate) + Send + Sync>;

/// The checkpoint/restore engine of one node.
pub struct Engine {
    criu: Criu,
    criu_version: CriuVersion,
    /// Whether this CRIU can dump network sockets on this kernel (`Err(why)` if not).
    network_sockets: Result<(), String>,
    /// How established TCP connections are locked during dumps (`Err(why)` if no way is).
    network_lock: Result<NetworkLock, String>,
    store: Store,
    state: StateDir,
    registry: Registry,
    reaper: Reaper,
    jobs: TaskTracker,
    staging_limit: u64,
    keep_last: Option<usize>,
    gc_grace: std::time::Duration,
    lazy: crate::store::FetchSettings,
    /// The NVIDIA driver's checkpoint API, when a driver is installed.
    gpu: Option<Arc<dyn GpuCheckpointer>>,
    /// One job at a time per workload.
    workload_locks: tokio::sync::Mutex<HashMap<String, Arc<tokio::sync::Mutex<()>>>>,
}

impl Engine {
    /// Checks CRIU, opens the store and the state directory, becomes the reaper of restored
    /// trees, and removes what an interrupted previous run left behind.
    pub async fn start(config: EngineConfig) -> Result<Arc<Self>, StartError> {
        let criu = Criu::new(&config.criu_path);
        if !config.criu_path.exists() {
            return Err(StartError::CriuMissing(config.criu_path));
        }
        let state = StateDir::open(&config.state_dir)
            .map_err(|source| StartError::State { path: config.state_dir.clone(), source })?;
        let criu_version = {
            let criu = criu.clone();
            let version = tokio::task::spawn_blocking(move || criu.version()).await;
            version.map_err(StartError::Task)?
        }
        .map_err(|source| StartError::CriuUnusable { path: config.criu_path.clone(), source })?;
        if criu_version < MIN_VERSION {
            return Err(StartError::CriuTooOld { path: config.criu_path, version: criu_version });
        }
        let check_dir = state
            .new_work_dir("criu-check")
            .map_err(|source| StartError::State { path: config.state_dir.clone(), source })?;
        {
            let (criu, dir) = (criu.clone(), check_dir.path().to_path_buf());
            tokio::task::spawn_blocking(move || criu.check(&dir))
                .await
                .map_err(StartError::Task)?
                .map_err(|source| StartError::CriuCheck { path: config.criu_path.clone(), source })?;
        }
        drop(check_dir);
        let network_sockets = support::network_sockets(criu_version, &crate::linux::proc::kernel_release());
        let network_lock = {
            let criu = criu.clone();
            let forced = config.network_lock;
            tokio::task::spawn_blocking(move || support::choose_network_lock(&criu, forced))
                .await
                .map_err(StartError::Task)?
        };
        if let (Some(lock), Err(why)) = (config.network_lock, &network_lock) {
            return Err(StartError::NetworkLock { lock: lock.name(), why: why.clone() });
        }
        match (&network_sockets, &network_lock) {
            (Ok(()), Ok(lock)) => info!(network_lock = lock.name(), "sockets supported"),
            (Err(why), _) => warn!(reason = %why, "trees holding network sockets will be refused"),
            (_, Err(why)) => warn!(reason = %why, "trees holding TCP connections will be refused"),
        }
        let store =
            Store::open(&config.store_url, config.store_retry)?.with_node_tag(&node_tag(&config.state_dir));
        let registry = Registry::load(&state.registry_file())
            .map_err(|source| StartError::State { path: state.registry_file(), source })?;
        let reaper = Reaper::start().map_err(StartError::Reaper)?;
        let engine = Self {
            criu,
            criu_version,
            network_sockets,
            network_lock,
            store,
            state,
            registry,
            reaper,
            jobs: TaskTracker::new(),
            staging_limit: config.staging_limit.unwrap_or_else(dump::default_staging_limit),
            gpu: load_gpu(),
            keep_last: config.keep_last,
            gc_grace: config.gc_grace,
            lazy: config.lazy,
            workload_locks: Default::default(),
        };
        engine.recover().await;
        info!(criu = %engine.criu.path().display(), version = %criu_version, store = %config.store_url, "engine ready");
        Ok(Arc::new(engine))
    }

    /// Removes the cgroup of a workload whose tree is gone (CRIU recreates it on restore).
    fn release_cgroup(&self, workload: &str) {
        if let Some(path) = self.registry.get(workload).and_then(|w| w.cgroup) {
            WorkloadCgroup { path }.remove_if_empty();
        }
    }

    /// Removes work directories, cgroups of workloads that are gone, and the packs of uploads
    /// that a crash interrupted.
    async fn recover(&self) {
        for w in self.registry.all().iter().filter(|w| !crate::linux::proc::is_running(w.pid)) {
            self.release_cgroup(&w.name);
        }
        if let Err(e) = self.state.clear_work() {
            warn!(error = %e, "cannot clear old work directories");
        }
        let interrupted = self.state.inflight().unwrap_or_default();
        if interrupted.is_empty() {
            return;
        }
        match self.store.gc(None, self.gc_grace, true).await {
            Ok(report) => {
                info!(checkpoints = ?interrupted, packs = report.packs_deleted, "removed data of interrupted checkpoints");
                interrupted.iter().for_each(|id| self.state.clear_inflight(id));
            }
            Err(e) => {
                warn!(error = %e, "cannot remove data of interrupted checkpoints; the next start retries")
            }
        }
    }

    /// The tracker of running jobs; closing and waiting on it drains the engine.
    pub fn jobs(&self) -> &TaskTracker {
        &self.jobs
    }

    async fn lock_workload(&self, name: &str) -> tokio::sync::OwnedMutexGuard<()> {
        let lock = self.workload_locks.lock().await.entry(name.to_string()).or_default().clone();
        lock.lock_owned().await
    }
}

/// A short tag for this node (host name and state directory), prefixed to its pack ids.
fn node_tag(state_dir: &std::path::Path) -> String {
    let seed = format!("{}:{}", crate::linux::proc::node_name(), state_dir.display());
    hex::encode(&blake3::hash(seed.as_bytes()).as_bytes()[..4])
}

/// Loads the NVIDIA driver's checkpoint API; without a driver stasis checkpoints CPU-only trees.
fn load_gpu() -> Option<Arc<dyn GpuCheckpointer>> {
    match CudaDriver::load() {
        Ok(driver) => {
            info!(driver = driver.driver_version(), "GPU checkpointing available");
            Some(Arc::new(driver))
        }
        Err(CudaError::NotInstalled { .. }) => {
            info!("no NVIDIA driver: GPU checkpointing unavailable");
            None
        }
        Err(e) => {
            warn!(error = %e, "NVIDIA driver unusable for checkpointing");
            None
        }
    }
}
