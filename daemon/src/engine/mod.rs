//! The engine: stasis's typed domain API. The gRPC layer only converts types and calls it.
//!
//! Long operations (checkpoint, restore) run as jobs tracked by [`Engine::jobs`], so a
//! shutting-down daemon can wait for them: a job that has started always finishes or rolls
//! back, also when its client goes away.

mod access;
pub mod archive;
mod checkpoint;
mod compat;
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
mod settings;
mod slots;
mod sockets;
mod start;
mod state;
#[cfg(test)]
mod store_faults;
mod unsupported;
mod workloads;

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
pub use settings::{EngineConfig, Settings};
use tokio_util::task::TaskTracker;
pub use workloads::Workload;

use parts::{Deps, Shared};
use slots::Slots;
use start::CriuSupport;
use workloads::Registry;

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
    /// How its jobs behave (from `EngineConfig`).
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
