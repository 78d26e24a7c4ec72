//! The engine: stasis's typed domain API. The gRPC layer only converts types and calls it.
//!
//! Long operations (checkpoint, restore) run as jobs tracked by [`Engine::jobs`], so a
//! shutting-down daemon can wait for them: a job that has started always finishes or rolls
//! back, also when its client goes away.

mod checkpoint;
mod error;
mod ids;
mod inspect;
mod query;
mod restore;
mod run;
mod state;
mod workloads;

use std::collections::HashMap;
use std::path::PathBuf;
use std::sync::Arc;

pub use checkpoint::{CheckpointOutcome, CheckpointParams, CheckpointStats, Target};
pub use error::{CheckpointError, QueryError, RestoreError, RunError, StartError};
pub use ids::{now_unix_ms, valid_checkpoint_id};
pub use query::{CheckpointSummary, StatusReport};
pub use restore::{RestoreOutcome, RestoreParams, RestoreStats, RestoreTarget};
pub use run::{RunOutcome, RunParams};
use tokio_util::task::TaskTracker;
use tracing::{info, warn};
pub use workloads::Workload;

use crate::criu::{Criu, CriuVersion, MIN_VERSION};
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
    store: Store,
    state: StateDir,
    registry: Registry,
    reaper: Reaper,
    jobs: TaskTracker,
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
            version.map_err(|e| StartError::Reaper(std::io::Error::other(e)))?
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
                .map_err(|e| StartError::Reaper(std::io::Error::other(e)))?
                .map_err(|source| StartError::CriuCheck { path: config.criu_path.clone(), source })?;
        }
        drop(check_dir);
        let store = Store::open(&config.store_url)?;
        let registry = Registry::load(&state.registry_file())
            .map_err(|source| StartError::State { path: state.registry_file(), source })?;
        let reaper = Reaper::start().map_err(StartError::Reaper)?;
        let engine = Self {
            criu,
            criu_version,
            store,
            state,
            registry,
            reaper,
            jobs: TaskTracker::new(),
            workload_locks: Default::default(),
        };
        engine.recover().await;
        info!(criu = %engine.criu.path().display(), version = %criu_version, store = %config.store_url, "engine ready");
        Ok(Arc::new(engine))
    }

    /// Removes uploads and work directories a crashed previous run left behind.
    async fn recover(&self) {
        if let Err(e) = self.state.clear_work() {
            warn!(error = %e, "cannot clear old work directories");
        }
        for id in self.state.inflight().unwrap_or_default() {
            match self.store.remove_uncommitted(&id).await {
                Ok(()) => {
                    info!(checkpoint = %id, "removed data of an interrupted checkpoint");
                    self.state.clear_inflight(&id);
                }
                Err(e) => {
                    warn!(checkpoint = %id, error = %e, "cannot remove interrupted checkpoint")
                }
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
