//! What an engine is made of, besides its workloads: what it drives ([`Deps`]) and what all
//! its jobs share ([`Shared`]); and the engine assembled from them, its settings
//! (`settings.rs`) and what CRIU and the kernel can do on this node (`start::CriuSupport`).

use std::collections::HashMap;
use std::path::PathBuf;
use std::sync::Arc;

use tokio_util::task::TaskTracker;

use super::checkpoint::dump;
use super::host::Host;
use super::idle::GpuWatch;
use super::sockets::LeftLocks;
use super::start::CriuSupport;
use super::state::StateDir;
use super::workloads::Registry;
use super::{Engine, EngineConfig};
use crate::criu::CriuOps;
use crate::cuda::GpuCheckpointer;
use crate::linux::reaper::Reaper;
use crate::store::{BlockPool, StagingBudget, Store};

/// What the engine drives, and where it keeps its data.
pub(super) struct Deps {
    pub criu: Arc<dyn CriuOps>,
    /// The kernel, as the jobs see it.
    pub host: Arc<dyn Host>,
    /// The NVIDIA driver's checkpoint API, when a driver is installed.
    pub gpu: Option<Arc<dyn GpuCheckpointer>>,
    /// Which processes use a GPU (NVML), when a driver is installed.
    pub gpu_activity: Option<GpuWatch>,
    pub store: Store,
    pub state: StateDir,
    pub reaper: Reaper,
}

/// What all jobs share.
pub(super) struct Shared {
    /// Staged page bytes all dumps together may hold in memory.
    pub staging: StagingBudget,
    /// The buffers of evictions' pages on their way to the store (see `store/stream.rs`).
    pub blocks: BlockPool,
    /// The network locks evictions left on this node.
    pub left_locks: LeftLocks,
    /// Dumps of trees whose namespace inits share a working directory (copies of one
    /// checkpoint) run one at a time: CRIU mounts a /proc in it, under one name.
    pub init_dir_locks: KeyedLocks<PathBuf>,
    /// Each workload's last tracked checkpoint, which its next dump builds on.
    pub chains: super::checkpoint::Chains,
}

/// A lock per key, made on first use.
pub(super) type KeyedLocks<K> = tokio::sync::Mutex<HashMap<K, Arc<tokio::sync::Mutex<()>>>>;

/// The lock of `key` in `locks`, held.
pub(super) async fn hold<K: std::hash::Hash + Eq>(
    locks: &KeyedLocks<K>,
    key: K,
) -> tokio::sync::OwnedMutexGuard<()> {
    let lock = locks.lock().await.entry(key).or_default().clone();
    lock.lock_owned().await
}

impl Engine {
    /// An engine of `deps` and `registry`, on a node that can do what `support` says, with
    /// the settings of `config`.
    pub(super) fn assemble(
        deps: Deps,
        support: CriuSupport,
        registry: Registry,
        config: &EngineConfig,
    ) -> Engine {
        let staging_limit =
            config.staging_limit.unwrap_or_else(|| dump::default_staging_limit(deps.host.as_ref()));
        let mut settings = config.settings;
        settings.eager_served &= support.served_memory.is_ok();
        let shared = Shared {
            staging: StagingBudget::new(staging_limit),
            blocks: Default::default(),
            left_locks: LeftLocks::at(deps.state.netlocks_dir(), deps.host.clone()),
            init_dir_locks: Default::default(),
            chains: Default::default(),
        };
        Engine {
            deps,
            support,
            settings,
            registry,
            workloads: Default::default(),
            shared,
            jobs: TaskTracker::new(),
            metrics: Default::default(),
        }
    }
}
