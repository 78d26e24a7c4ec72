//! The engine: stasis's typed domain API. The gRPC layer only converts types and calls it.
//!
//! Long operations (checkpoint, restore) run as jobs tracked by [`Engine::jobs`], so a
//! shutting-down daemon can wait for them: a job that has started always finishes or rolls
//! back, also when its client goes away.

mod access;
pub mod archive;
mod checkpoint;
mod compat;
mod dump;
mod error;
mod evacuate;
mod gpu;
mod gpu_map;
mod home;
mod host;
mod hot_restore;
mod idle;
mod ids;
mod inspect;
mod parts;
mod periodic;
pub mod pods;
mod query;
mod restore;
#[cfg(test)]
mod rollback_tests;
mod run;
mod slots;
mod sockets;
mod start;
mod state;
#[cfg(test)]
mod store_faults;
mod unsupported;
mod workloads;

use std::path::PathBuf;
use std::sync::Arc;

pub use access::Caller;
pub use checkpoint::{AnswerWhen, CheckpointOutcome, CheckpointParams, CheckpointStats, EarlyAnswer, Target};
pub use error::{CheckpointError, PolicyError, QueryError, RestoreError, RunError, StartError};
pub use evacuate::plan::CheckpointCost;
pub use evacuate::{EvacuateParams, Evacuation};
pub use hot_restore::LazyError;
pub use idle::{GpuActivity, IdleSettings, IdleState, Thresholds};
pub use ids::{now_unix_ms, valid_checkpoint_id};
pub use query::{CheckpointList, CheckpointSummary, StatusReport, WorkloadReport};
pub use restore::{RestoreOutcome, RestoreParams, RestoreStats, RestoreTarget};
pub use run::{Pids, RunOutcome, RunParams};
use tokio_util::task::TaskTracker;
pub use workloads::Workload;

use crate::criu::NetworkLock;
use parts::{Deps, Settings, Shared};
use slots::Slots;
use start::CriuSupport;
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
    /// Eager restores write memory into image files for CRIU, even where stasisd could put it
    /// in place itself.
    pub eager_from_files: bool,
    /// The network lock to use; `None` picks one (see [`crate::criu::support::choose_network_lock`]).
    pub network_lock: Option<NetworkLock>,
    /// How long the network lock of an eviction is kept for a restore on this node.
    pub network_lock_keep: std::time::Duration,
    /// How idle workloads are told from busy ones.
    pub idle: IdleSettings,
    /// The store's encryption key, and (once, for rotation) the key it was wrapped with.
    pub store_key: Option<crate::store::crypto::StoreKey>,
    pub rotate_store_key_from: Option<crate::store::crypto::StoreKey>,
    /// How long a preemption notice gives, when they are watched (periodic intervals of spot
    /// workloads adapt to it).
    pub notice_window: Option<std::time::Duration>,
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
    /// What it drives: CRIU, the kernel, the GPU, the store, the state directory, the reaper.
    deps: Deps,
    /// What CRIU and the kernel can do on this node, found at start.
    support: CriuSupport,
    /// How it is set (from `EngineConfig`).
    settings: Settings,
    /// The workloads it knows, persisted in the state directory.
    registry: Registry,
    /// What is under way for each workload: its job, idle reclaim, periodic checkpoints and
    /// evacuation (see `slots.rs`).
    workloads: Slots,
    /// What all jobs share: memory budgets, network locks left behind, locks across workloads.
    shared: Shared,
    jobs: TaskTracker,
    metrics: Arc<crate::metrics::Metrics>,
}

/// `m` locked; a poisoned lock is taken as it is (its holder panicked, the data is still
/// the engine's best knowledge).
fn lock<T>(m: &std::sync::Mutex<T>) -> std::sync::MutexGuard<'_, T> {
    m.lock().unwrap_or_else(|p| p.into_inner())
}

impl Engine {
    /// Runs `job` as a tracked job, which finishes even if its caller goes away; its failure
    /// is logged as "`what` failed", and its result handed to `record` for the metrics.
    async fn tracked<T: Send + 'static, E: std::error::Error + Send + 'static>(
        self: &Arc<Self>,
        what: &'static str,
        job: impl std::future::Future<Output = Result<T, E>> + Send + 'static,
        record: fn(&crate::metrics::Metrics, &Result<T, E>),
    ) -> Result<Result<T, E>, tokio::task::JoinError> {
        let metrics = self.metrics.clone();
        self.jobs
            .spawn(async move {
                let result = job.await;
                if let Err(e) = &result {
                    tracing::warn!(error = %crate::error_chain(e), "{what} failed");
                }
                record(&metrics, &result);
                result
            })
            .await
    }

    /// Removes the cgroup of a workload whose tree is gone (CRIU recreates it on restore).
    fn release_cgroup(&self, workload: &str) {
        if let Some(path) = self.registry.get(workload).and_then(|w| w.cgroup) {
            self.deps.host.remove_empty_cgroup(&path);
        }
    }

    /// What the engine counts and times, for `--metrics-listen`.
    pub fn metrics(&self) -> Arc<crate::metrics::Metrics> {
        self.metrics.clone()
    }

    /// The tracker of running jobs; closing and waiting on it drains the engine.
    pub fn jobs(&self) -> &TaskTracker {
        &self.jobs
    }

    /// Waits for the turn of workload `name` to run a job: one at a time per workload.
    async fn lock_workload(&self, name: &str) -> slots::JobTurn<'_> {
        self.workloads.job_turn(name).await
    }
}
