//! The restore job: fetch and verify the checkpoint, then let CRIU recreate the tree.
//!
//! ```text
//! manifest (verified) -> preflight: pids free, ports and addresses, GPUs placed
//!   -> download images (size + BLAKE3 checked; a lazy restore leaves memory in the store)
//!   -> CRIU restore (the root becomes stasisd's child) -> GPU state back -> registry updated
//!   -> lazy: wait until every page is resident
//! ```
//! Nothing partly restored is left running: CRIU kills a tree it could not restore, and a
//! failure after CRIU's restore kills the tree ([`Restored`], and the lazy session).

use std::os::fd::OwnedFd;
use std::path::Path;
use std::sync::Arc;
use std::time::{Duration, Instant};

use tracing::{info, instrument, warn};

use super::checkpoint::tree_options;
use super::compat;
use super::gpu::{self, GpuError};
use super::gpu_map;
use super::home::{Home, init_dir_again};
use super::hot_restore::{FaultGuard, KillTree, LazyError, LazySession, Roots, tree_killer};
use super::ids::{ms, valid_checkpoint_id};
use super::pods::{self, ContainerRef};
use super::sockets::{self, needs_network_support};
use super::workloads::{Workload, is_container_name, valid_name};
use super::{Caller, Engine, ProgressFn, ProgressUpdate, RestoreError, lock};
use crate::criu::RestoreSpec;
use crate::cuda::GpuUuid;
use crate::metrics::{Failure, Metrics, RestoreSample};
use crate::store::{LazyMemory, Manifest, MemoryMode};

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

    /// The home on this node of the tree restored as `name`: its log, its cgroup if it had
    /// one, and its namespace init's directory made again if it is gone.
    fn restored_home(&self, manifest: &Manifest, name: &str, caller: Caller) -> Result<Home, RestoreError> {
        let home = self
            .home(name, caller, !manifest.cgroup.is_empty())
            .map_err(|(what, e)| RestoreError::local(what)(e))?;
        if !manifest.init_dir.is_empty() {
            init_dir_again(&manifest.init_dir).map_err(RestoreError::local("its init's directory"))?;
        }
        Ok(home)
    }

    /// Whether the restored tree may be workload `name`: not a reclaimed one, and a name of
    /// its own (`--as`) only for a tree with its own pid namespace, and not one that runs.
    fn check_name(&self, manifest: &Manifest, name: &str, caller: Caller) -> Result<(), RestoreError> {
        let existing = self.registry.get(name);
        if existing.as_ref().is_some_and(|w| w.reclaimed.is_some()) {
            return Err(RestoreError::Reclaimed(name.to_owned()));
        }
        let runs = existing.as_ref().is_some_and(|w| self.deps.host.is_running(w.pid));
        if caller != Caller::Root && is_container_name(name) {
            let why = "names beginning with k8s. are Kubernetes containers', and root's";
            return Err(RestoreError::BadName { name: name.to_owned(), why });
        }
        if name == manifest.workload {
            return match runs && manifest.own_pid_namespace {
                // Its pids would not stop it, but the workload's record would lose the one running.
                true => Err(RestoreError::BadName {
                    name: name.to_owned(),
                    why: "it runs already; give another copy a name of its own with --as",
                }),
                false => Ok(()),
            };
        }
        let why = if !valid_name(name) {
            "it is not a valid workload name"
        } else if !manifest.own_pid_namespace {
            "it keeps its pids (a process checkpointed by pid, or run with --host-pids), so only one copy can run"
        } else if runs || existing.is_some_and(|w| !caller.owns(w.owner_uid)) {
            "a running workload (or another user's) has that name"
        } else {
            return Ok(());
        };
        Err(RestoreError::BadName { name: name.to_owned(), why })
    }

    /// The pids that `pids` (as the checkpoint recorded them) have in the tree restored with
    /// root `root`: the same, unless the tree has its own pid namespace or was a container's,
    /// whose restore numbers them anew outside it (matched by their pids inside it).
    fn restored_pids(&self, manifest: &Manifest, root: i32, pids: &[i32]) -> Vec<i32> {
        let inner_pids = match (manifest.own_pid_namespace, &manifest.pod) {
            (true, _) => &manifest.ns_pids,
            (false, Some(pod)) => &pod.inner_pids,
            (false, None) => return pids.to_vec(),
        };
        let now: Vec<(i32, Option<i32>)> = self
            .deps
            .host
            .trees(&[root])
            .into_iter()
            .map(|p| (p, self.deps.host.pid_inside(p, root)))
            .collect();
        let inside = |pid: &i32| {
            let at = manifest.pids.iter().position(|p| p == pid)?;
            let ns_pid = *inner_pids.get(at)?;
            now.iter().find(|(_, inner)| *inner == Some(ns_pid)).map(|(p, _)| *p)
        };
        pids.iter().filter_map(inside).collect()
    }

    /// Checks, before anything is restored, that this node (or container `into`) can take
    /// the checkpoint: its pids free (unless it brings a pid namespace of its own), its
    /// sockets' ports and addresses, its GPUs.
    pub(super) async fn preflight(
        &self,
        manifest: &Manifest,
        gpu_map: &[(GpuUuid, GpuUuid)],
        tcp_close: bool,
        into: Option<&ContainerRef>,
    ) -> Result<Preflight, RestoreError> {
        let id = manifest.id.clone();
        // A tree with a pid namespace of its own, or restored into a container's, takes no pid
        // of this host's.
        let busy = match manifest.own_pid_namespace || manifest.pod.is_some() {
            true => Vec::new(),
            false => self.deps.reaper.wait_gone(&manifest.pids, PIDS_FREE_WAIT).await,
        };
        if !busy.is_empty() {
            return Err(RestoreError::PidsInUse { id, pids: busy });
        }
        let warnings = sockets::check_restore(self.deps.host.as_ref(), &manifest.sockets, tcp_close)
            .map_err(|reason| RestoreError::Sockets { id: id.clone(), reason })?;
        if needs_network_support(&manifest.sockets)
            && let Err(why) = &self.support.network_sockets
        {
            let reason = format!("the checkpoint holds network sockets, and {why}");
            return Err(RestoreError::Sockets { id, reason });
        }
        for warning in &warnings {
            warn!(checkpoint = %id, warning = %warning, "the restored tree will notice");
        }
        if let Some(reason) = compat::mismatch(manifest, &self.deps.host.cpu_flags(), self.support.version) {
            return Err(RestoreError::Incompatible { id, reason });
        }
        if manifest.pod.is_some() && !manifest.gpu_pids.is_empty() && into.is_none() {
            let reason = "a container's CUDA processes are restored only into a container".to_owned();
            return Err(RestoreError::Incompatible { id, reason });
        }
        // At least one GPU: a checkpoint's CUDA processes had one open, named or not.
        let needed = manifest.gpus.len().max(1);
        if let Some(c) = into
            && !manifest.gpu_pids.is_empty()
            && c.gpu_devices.len() < needed
        {
            let reason = format!(
                "its CUDA processes used {needed} GPU(s), and container {} was given {} ({}): give \
                 the pod as many GPUs as the one it replaces",
                c.id,
                c.gpu_devices.len(),
                c.gpu_devices.join(", ")
            );
            return Err(RestoreError::Incompatible { id, reason });
        }
        let gpu_pairs = self.place_gpus(manifest, gpu_map, into.map(|c| c.init_pid)).await?;
        Ok(Preflight { warnings, gpu_pairs })
    }

    /// Writes the checkpoint's images into `dir`, leaving the memory stasisd puts in place
    /// itself in the store, and returns it: for a lazy restore, all CRIU can restore lazily
    /// but the host copies of device memory (the CUDA restore reads them at once); for an
    /// eager one all it can, unless eager restores use image files (`--eager-restore files`,
    /// or a kernel without the userfaultfd it needs).
    async fn fetch_images(
        &self,
        manifest: &Manifest,
        dir: &Path,
        lazy: bool,
        progress: &ProgressFn,
    ) -> Result<(u64, LazyMemory), RestoreError> {
        let report: crate::store::Progress = {
            let progress = progress.clone();
            Arc::new(move |done, total| progress(ProgressUpdate { phase: "download", done, total }))
        };
        let mode = match (lazy, self.settings.eager_served) {
            (true, _) => MemoryMode::Lazy { eager: &manifest.gpu_host_memory },
            (false, true) => MemoryMode::Lazy { eager: &[] },
            (false, false) => MemoryMode::Eager,
        };
        Ok(self.deps.store.materialize_as(manifest, dir, mode, report).await?)
    }

    /// Lets CRIU restore the tree from `dir` (its memory put in place through `session`);
    /// returns the restored root's pid. A failure leaves nothing running: CRIU removes a tree
    /// it could not restore, and one whose fault guard did not start, or whose memory could
    /// not be put in place before it ran, is killed.
    async fn run_criu(
        &self,
        manifest: &Manifest,
        placement: &Placement,
        dir: &Path,
        tcp_close: bool,
        session: Option<LazySession>,
        progress: &ProgressFn,
    ) -> Result<(i32, Option<LazySession>), RestoreError> {
        let id = manifest.id.clone();
        let tree = tree_options(&manifest.options.clone().unwrap_or_default());
        let placed = match placement {
            Placement::Home(home) => replacement_files(manifest, home, &tree.external).map(|files| {
                (files, home.cgroup_in_hierarchy().filter(|_| !manifest.cgroup.is_empty()), None)
            }),
            Placement::Container(c) => {
                pods::prepare_restore(self.deps.host.as_ref(), manifest, c, &self.deps.reaper)
                    .await
                    .map(|(files, enter)| (files, None, Some(enter)))
                    .map_err(RestoreError::local("entering the container"))
            }
        };
        let (inherit_fds, cgroup, enter) = match placed {
            Ok(placed) => placed,
            Err(e) => {
                // Nothing was restored: the lazy-pages daemon started for it goes too.
                session.into_iter().for_each(LazySession::abort);
                return Err(e);
            }
        };
        progress(ProgressUpdate { phase: "restore", done: 0, total: 0 });
        let spec = RestoreSpec {
            images_dir: dir.to_path_buf(),
            tree,
            inherit_fds,
            lazy_pages: session.is_some(),
            tcp_close,
            cgroup,
            enter,
            running: session.as_ref().map(LazySession::running_criu),
        };
        session.iter().for_each(LazySession::arm);
        let faults = session.as_ref().map(LazySession::fault_guard);
        if let Some(guard) = &faults {
            guard.hand_over(spec.inherit_fds.iter().filter_map(|(_, fd)| file_id(fd)).collect());
        }
        let lazy = session.as_ref().is_some_and(LazySession::is_lazy);
        let pre_resume = session.as_ref().map(LazySession::pre_resume);
        let mut on_notify =
            move |script: &str, criu: i32| match pre_resume.as_ref().filter(|_| script == "pre-resume") {
                Some(pre_resume) => pre_resume(criu),
                None => Ok(()),
            };
        let criu = self.deps.criu.clone();
        let restored = tokio::task::spawn_blocking(move || criu.restore(&spec, &mut on_notify))
            .await
            .map_err(RestoreError::panicked("restore thread"))
            .and_then(|r| r.map_err(|source| RestoreError::Criu { id: id.clone(), source }));
        let unguarded = faults.as_ref().and_then(FaultGuard::not_started);
        match (restored, unguarded) {
            (Ok(pid), None) => Ok((pid, session)),
            (Ok(pid), Some(reason)) => {
                // CRIU only logs a failed notification and lets the tree run: kill it, since
                // nothing guards its faults.
                if let Some(session) = session {
                    session.kill_tree();
                    session.abort();
                }
                Err(RestoreError::Lazy { id, lazy, pid, source: LazyError::Guard(reason) })
            }
            (Err(e), _) => {
                let Some(mut session) = session else { return Err(e) };
                // The reason the tree was killed at pre-resume, if it was.
                let guard_failed = faults.as_ref().and_then(FaultGuard::failed).map(LazyError::Guard);
                let served = session.serve_failure().await.or(guard_failed);
                session.abort();
                match (served, e) {
                    (Some(source), RestoreError::Criu { source: criu, .. }) => {
                        Err(RestoreError::LazyDuringRestore { id, lazy, source, criu: Box::new(criu) })
                    }
                    (_, e) => Err(e),
                }
            }
        }
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

    /// Where the checkpoint's GPU state goes on this node, among the GPUs the container whose
    /// init is `container_init` was given if it goes into one; refuses an incompatible target
    /// before anything is restored.
    async fn place_gpus(
        &self,
        manifest: &Manifest,
        explicit: &[(GpuUuid, GpuUuid)],
        container_init: Option<i32>,
    ) -> Result<Vec<(GpuUuid, GpuUuid)>, RestoreError> {
        if manifest.gpu_pids.is_empty() {
            return Ok(Vec::new());
        }
        let id = manifest.id.clone();
        let gpu = self.gpu_for(container_init).ok_or_else(|| RestoreError::Gpu {
            id: id.clone(),
            source: GpuError::NoDriver(manifest.gpu_pids.clone()),
        })?;
        let present = tokio::task::spawn_blocking(move || gpu.gpus())
            .await
            .map_err(RestoreError::panicked("GPU thread"))?
            .map_err(|e| RestoreError::Gpu { id: id.clone(), source: GpuError::Query(e) })?;
        gpu_map::plan(&manifest.gpus, &present, explicit)
            .map_err(|source| RestoreError::GpuPlacement { id, source: Box::new(source) })
    }

    /// Records the restored tree in the workload registry. A failure is logged, not
    /// returned: the tree runs, and the registry is bookkeeping.
    fn remember_restore(&self, manifest: &Manifest, placement: &Placement, name: &str, pid: i32) {
        let recorded = match placement {
            Placement::Home(home) => self.record_restore(manifest, home, name, pid),
            Placement::Container(_) => self.registry.update(name, |w| {
                w.pid = pid;
                w.last_checkpoint = Some(manifest.id.clone());
                w.last_error = None;
            }),
        };
        if let Err(e) = recorded {
            warn!(workload = %name, error = %e, "cannot record the restore in the workload registry");
        }
    }

    fn record_restore(&self, manifest: &Manifest, home: &Home, name: &str, pid: i32) -> std::io::Result<()> {
        let cgroup = home.cgroup.clone();
        // A copy (`--as`) gets a record of its own, even over an old one of that name.
        if name == manifest.workload && self.registry.get(name).is_some() {
            return self.registry.update(name, |w| {
                w.pid = pid;
                w.last_error = None;
                w.cgroup = cgroup;
            });
        }
        self.registry.put(Workload {
            name: name.to_owned(),
            pid,
            command: manifest.command.clone(),
            managed: !manifest.log_file.is_empty(),
            log_path: Some(home.log_path.clone()),
            cgroup,
            last_checkpoint: Some(manifest.id.clone()),
            owner_uid: manifest.owner_uid,
            ..Default::default()
        })
    }
}

/// Where a restored tree goes.
enum Placement {
    /// This node's home of the workload it becomes (its log, cgroup, init's directory).
    Home(Home),
    /// A Kubernetes container, as its init's child (see `pods/`).
    Container(ContainerRef),
}

/// What the restored tree gets in place of what it held outside itself: the workload's log
/// on this node for the log file it wrote to, and a new terminal, logged there too, for each
/// terminal it had.
fn replacement_files(
    manifest: &Manifest,
    home: &Home,
    external: &[String],
) -> Result<Vec<(String, OwnedFd)>, RestoreError> {
    let mut files: Vec<(String, OwnedFd)> = external
        .iter()
        .filter(|k| crate::linux::pty::is_tty_key(k))
        .map(|key| Ok((key.clone(), home.terminal()?)))
        .collect::<std::io::Result<_>>()
        .map_err(RestoreError::local("terminal"))?;
    if let Some(path) = manifest.log_file.strip_prefix('/') {
        // CRIU names a regular file by its path without the leading slash.
        let log = home.log.try_clone().map_err(RestoreError::local("its log file"))?;
        files.push((path.to_owned(), log.into()));
    }
    Ok(files)
}

/// The device and inode of the file open as `fd`.
fn file_id(fd: &std::os::fd::OwnedFd) -> Option<(u64, u64)> {
    nix::sys::stat::fstat(fd).ok().map(|st| (st.st_dev, st.st_ino))
}

/// The restored tree's roots as known before CRIU runs: the recorded pids, or none yet for a
/// tree with its own pid namespace or restored into a container (its root is known once CRIU
/// created it).
fn initial_roots(manifest: &Manifest) -> Roots {
    let renumbered = manifest.own_pid_namespace || manifest.pod.is_some();
    let known = if renumbered { Vec::new() } else { manifest.pids.clone() };
    Arc::new(std::sync::Mutex::new(known))
}

/// What [`Engine::preflight`] found.
pub(super) struct Preflight {
    /// What the restored tree will notice (see `sockets::check_restore`).
    warnings: Vec<String>,
    /// Where its GPU state goes: (checkpoint GPU, this node's GPU).
    gpu_pairs: Vec<(GpuUuid, GpuUuid)>,
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
