//! Starting the engine: CRIU checked (version, `criu check`, what it can do for sockets), the
//! state directory, store and workload registry opened, the reaper started; then what an
//! interrupted previous run left behind is cleaned up.

use std::path::Path;
use std::sync::Arc;
use std::sync::atomic::AtomicI32;

use tracing::{info, warn};

use super::host::{Host, LinuxHost};
use super::hot_restore::{Roots, tree_killer};
use super::idle::GpuWatch;
use super::parts::Deps;
use super::sockets::{LeftLocks, SWEEP_EVERY};
use super::state::StateDir;
use super::workloads::Registry;
use super::{Engine, EngineConfig, GpuActivity, StartError};
use crate::criu::{Criu, CriuOps, CriuVersion, MIN_VERSION, NetworkLock, support};
use crate::cuda::nvml::Nvml;
use crate::cuda::{CudaDriver, CudaError, GpuCheckpointer};
use crate::linux::reaper::Reaper;
use crate::store::Store;

/// How long a restore's CRIU that a previous run left gets to end by itself.
const LEFT_CRIU_GRACE: std::time::Duration = std::time::Duration::from_secs(5);

/// What CRIU can do on this node, found at start.
#[derive(Debug, Clone)]
pub(super) struct CriuSupport {
    pub version: CriuVersion,
    /// Whether it can dump network sockets on this kernel (`Err(why)` if not).
    pub network_sockets: Result<(), String>,
    /// How it locks established TCP connections (`Err(why)` if no way is available).
    pub network_lock: Result<NetworkLock, String>,
    /// Whether stasisd can put restored memory in place itself (userfaultfd with the events
    /// CRIU's lazy restore needs): lazy restores need it, eager ones use it when they can.
    pub served_memory: Result<(), String>,
    /// Whether dumps track dirty pages (soft-dirty; `Err(why)` if not): a later checkpoint of
    /// a tree then reads only the pages written since its previous one.
    pub memory_tracking: Result<(), String>,
}

impl Engine {
    /// Checks CRIU, opens the store and the state directory, becomes the reaper of restored
    /// trees, and removes what an interrupted previous run left behind.
    pub async fn start(config: EngineConfig) -> Result<Arc<Self>, StartError> {
        if !config.criu_path.exists() {
            return Err(StartError::CriuMissing(config.criu_path));
        }
        let criu: Arc<dyn CriuOps> = Arc::new(Criu::new(&config.criu_path));
        let state_err = |path: &Path| {
            let path = path.to_path_buf();
            move |source| StartError::State { path, source }
        };
        let state = StateDir::open(&config.state_dir).map_err(state_err(&config.state_dir))?;
        let host: Arc<dyn Host> = Arc::new(LinuxHost);
        let support = probe_criu(&criu, host.as_ref(), &state, &config).await?;
        let store = Store::open(&config.store_url, config.store_retry)?
            .with_node_tag(&node_tag(host.as_ref(), &config.state_dir))
            .with_compression(config.compression)
            .unlock(config.store_key.as_ref(), config.rotate_store_key_from.as_ref())
            .await?;
        let registry = Registry::load(&state.registry_file()).map_err(state_err(&state.registry_file()))?;
        let reaper = Reaper::start().map_err(StartError::Reaper)?;
        let gpu = load_gpu();
        let gpu_activity = gpu.as_ref().and_then(|_| load_nvml()).map(GpuWatch::new);
        let deps = Deps { criu, host, gpu, gpu_activity, store, state, reaper };
        let engine = Engine::assemble(deps, support, registry, &config);
        engine.recover().await;
        sweep_left_locks(engine.shared.left_locks.clone(), config.network_lock_keep);
        info!(criu = %engine.deps.criu.path().display(), version = %engine.support.version, store = %config.store_url, compression = %config.compression, "engine ready");
        let engine = Arc::new(engine);
        engine.start_monitor();
        Ok(engine)
    }

    /// Takes back the trees that a restore had put in their workload's cgroup when a crash
    /// kept them out of the registry (a tree with a pid namespace of its own has new pids).
    fn adopt_restored(&self) {
        for w in self.registry.all().into_iter().filter(|w| !self.deps.host.is_running(w.pid)) {
            let Some(pid) = w.cgroup.and_then(|path| self.deps.host.cgroup_root(&path)) else {
                continue;
            };
            match self.registry.update(&w.name, |w| w.pid = pid) {
                Ok(()) => info!(workload = %w.name, pid, "took back a tree restored before the restart"),
                Err(e) => {
                    warn!(workload = %w.name, pid, error = %e, "cannot record a tree restored before the restart")
                }
            }
        }
    }

    /// Removes work directories, cgroups of workloads that are gone, and the packs of uploads
    /// that a crash interrupted.
    async fn recover(&self) {
        match self.deps.store.clear_own_leases().await {
            Ok(0) => {}
            Ok(n) => info!(leases = n, "cleared store leases a previous run left"),
            Err(e) => {
                warn!(error = %crate::error_chain(&e), "cannot clear store leases a previous run left; they expire by themselves")
            }
        }
        self.recover_held().await;
        self.adopt_restored();
        for w in self.registry.all().iter().filter(|w| !self.deps.host.is_running(w.pid)) {
            self.release_cgroup(&w.name);
        }
        self.end_left_restores();
        if let Err(e) = self.deps.state.clear_work() {
            warn!(error = %e, "cannot clear old work directories");
        }
        let interrupted = self.deps.state.inflight().unwrap_or_default();
        if interrupted.is_empty() {
            return;
        }
        match self.deps.store.gc(None, self.settings.gc_grace, true, std::time::Duration::ZERO).await {
            Ok(report) => {
                info!(checkpoints = ?interrupted, packs = report.packs_deleted, "removed data of interrupted checkpoints");
                interrupted.iter().for_each(|id| self.deps.state.clear_inflight(id));
            }
            Err(e) => {
                warn!(error = %e, "cannot remove data of interrupted checkpoints; the next start retries")
            }
        }
    }

    /// Ends the restores a crashed previous run left under way. Their CRIU cannot finish
    /// (its client is gone): it fails at its next word to stasisd and kills what it restored.
    /// One still there after [`LEFT_CRIU_GRACE`] is killed with the tree it restores: a CRIU
    /// that kills a tree with a pid namespace of its own can deadlock with it (the namespace's
    /// init waits for a child that CRIU still traces, CRIU waits for the init).
    fn end_left_restores(&self) {
        // Found by the directory's name, not by listing: the run before may have removed it
        // already (a restart itself killed within the grace).
        let state = &self.deps.state;
        let working = self.deps.host.working_dirs().into_iter();
        let criu: Vec<i32> =
            working.filter(|(_, dir)| state.is_restore_dir(dir)).map(|(pid, _)| pid).collect();
        if criu.is_empty() {
            return;
        }
        info!(pids = ?criu, "restores a previous run left are still under way; they cannot finish");
        let host = self.deps.host.clone();
        let left: Vec<(i32, u64)> = criu.iter().filter_map(|&p| Some((p, host.start_time(p)?))).collect();
        tokio::spawn(async move {
            let there = |&(pid, started): &(i32, u64)| host.still_running(pid, started);
            let deadline = std::time::Instant::now() + LEFT_CRIU_GRACE;
            while left.iter().any(there) && std::time::Instant::now() < deadline {
                tokio::time::sleep(std::time::Duration::from_millis(100)).await;
            }
            for &(pid, _) in left.iter().filter(|p| there(p)) {
                warn!(
                    pid,
                    "a previous run's restore did not end by itself: killing its CRIU and what it restores"
                );
                tree_killer(host.clone(), Roots::default(), Arc::new(AtomicI32::new(pid)))();
            }
        });
    }
}

/// Removes old network locks of evictions now and every [`SWEEP_EVERY`], for as long as the
/// daemon runs.
fn sweep_left_locks(locks: LeftLocks, keep: std::time::Duration) {
    tokio::spawn(async move {
        loop {
            let sweeping = locks.clone();
            let _ = tokio::task::spawn_blocking(move || sweeping.sweep(keep)).await;
            tokio::time::sleep(SWEEP_EVERY).await;
        }
    });
}

/// Asks CRIU its version, runs `criu check`, and finds what it can do for sockets on `host`.
async fn probe_criu(
    criu: &Arc<dyn CriuOps>,
    host: &dyn Host,
    state: &StateDir,
    config: &EngineConfig,
) -> Result<CriuSupport, StartError> {
    let path = config.criu_path.clone();
    let version = blocking(criu, |c| c.version())
        .await?
        .map_err(|source| StartError::CriuUnusable { path: path.clone(), source })?;
    if version < MIN_VERSION {
        return Err(StartError::CriuTooOld { path, version });
    }
    let check_dir = state
        .new_work_dir("criu-check")
        .map_err(|source| StartError::State { path: config.state_dir.clone(), source })?;
    let dir = check_dir.path().to_path_buf();
    blocking(criu, move |c| c.check(&dir)).await?.map_err(|source| StartError::CriuCheck { path, source })?;
    let network_sockets = support::network_sockets(version, &host.kernel_release());
    let forced = config.network_lock;
    let network_lock = blocking(criu, move |c| support::choose_network_lock(c, forced)).await?;
    if let (Some(lock), Err(why)) = (forced, &network_lock) {
        return Err(StartError::NetworkLock { lock: lock.name(), why: why.clone() });
    }
    match (&network_sockets, &network_lock) {
        (Ok(()), Ok(lock)) => info!(network_lock = lock.name(), "sockets supported"),
        (Err(why), _) => warn!(reason = %why, "trees holding network sockets will be refused"),
        (_, Err(why)) => warn!(reason = %why, "trees holding TCP connections will be refused"),
    }
    let served_memory = host.userfaultfd_events();
    if let Err(why) = &served_memory {
        warn!(reason = %why, "lazy restores will be refused; eager ones restore from image files");
    }
    log_kernel_features(host, &served_memory, &network_lock);
    let memory_tracking = match config.settings.memory_tracking {
        true => host.soft_dirty(),
        false => Err("turned off (--memory-tracking off)".into()),
    };
    match &memory_tracking {
        Ok(()) if host.huge_pages_mode().as_deref() == Some("always") => warn!(
            "memory tracking on, by 2 MiB where huge pages back memory (transparent huge pages are \
             'always'; 'madvise' tracks 4 KiB pages): a write anywhere in a huge page counts for all of it"
        ),
        Ok(()) => info!("memory tracking on: later checkpoints read only the pages written since"),
        Err(why) => info!(reason = %why, "memory tracking off: every checkpoint reads all memory"),
    }
    Ok(CriuSupport { version, network_sockets, network_lock, served_memory, memory_tracking })
}

/// Logs what of the kernel stasisd found, one line: userfaultfd with its fork, remap and unmap
/// events (served and lazy restores), soft-dirty tracking and the huge-page mode, pidfd_getfd
/// (looking at a tree's sockets), whether CRIU can dump rseq registrations, the TCP network
/// lock, and whether CRIU can keep its kernel probe between runs; then, for each one missing,
/// why.
fn log_kernel_features(
    host: &dyn Host,
    served_memory: &Result<(), String>,
    lock: &Result<NetworkLock, String>,
) {
    let soft_dirty = host.soft_dirty();
    let pidfd = host.pidfd_getfd();
    let rseq = support::rseq_dumpable(&host.kernel_release());
    let kernel_cache = host.criu_kernel_cache();
    let has = |found: &Result<(), String>| if found.is_ok() { "yes" } else { "no" };
    info!(
        kernel = %host.kernel_release(),
        userfaultfd_events = has(served_memory),
        soft_dirty = has(&soft_dirty),
        transparent_huge_pages = host.huge_pages_mode().as_deref().unwrap_or("none"),
        pidfd_getfd = has(&pidfd),
        rseq_dump = has(&rseq),
        network_lock = lock.as_ref().map_or("none", |lock| lock.name()),
        criu_kernel_cache = has(&kernel_cache),
        "kernel features"
    );
    if let Err(why) = &kernel_cache {
        warn!(
            reason = %why,
            "CRIU cannot keep what it probes of the kernel: every checkpoint and restore outside \
             a container probes it again (some tens of ms each); mount a tmpfs on /run"
        );
    }
    if let Err(why) = &rseq {
        warn!(
            reason = %why,
            "workloads started by `stasis run` get GLIBC_TUNABLES=glibc.pthread.rseq=0; other trees whose \
             glibc registered rseq fail to dump"
        );
    }
    if let Err(why) = &pidfd {
        warn!(reason = %why, "stasisd cannot copy a tree's socket descriptors to inspect them");
    }
}

/// Runs `f` on CRIU in a blocking thread.
async fn blocking<T: Send + 'static>(
    criu: &Arc<dyn CriuOps>,
    f: impl FnOnce(&dyn CriuOps) -> T + Send + 'static,
) -> Result<T, StartError> {
    let criu = criu.clone();
    tokio::task::spawn_blocking(move || f(criu.as_ref())).await.map_err(StartError::Task)
}

/// A short tag for this node (`host`'s name and the state directory), prefixed to its pack ids.
fn node_tag(host: &dyn Host, state_dir: &Path) -> String {
    let seed = format!("{}:{}", host.node_name(), state_dir.display());
    hex::encode(&blake3::hash(seed.as_bytes()).as_bytes()[..4])
}

/// Loads NVML, for idle reclaim's GPU activity signal.
fn load_nvml() -> Option<Arc<dyn GpuActivity>> {
    match Nvml::load() {
        Ok(nvml) => Some(Arc::new(nvml)),
        Err(e) => {
            warn!(error = %e, "NVML unusable: idle workloads are judged by CPU and reads only");
            None
        }
    }
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
