//! Kubernetes containers.
//!
//! An opted-in container runs its command under `stasis-pod`, its init (pid 1 of its pid
//! namespace). stasisd learns of the container from the NRI plugin (or `stasis container
//! register`): its id, its init's pid, its image and its stable identity, which names its
//! workload, so that every pod that takes the place of an evicted one finds its checkpoints.
//!
//! The container's tree is its init's one child and that child's descendants. A preStop hook
//! asks, through the pod endpoint (`endpoint.rs`), for an eviction checkpoint of it; CRIU
//! dumps it from inside the container's namespaces. When a new container of the same identity
//! and image starts, its init asks whether a checkpoint waits, and the tree is restored into
//! the container as the init's child (`restore.rs`).

mod endpoint;
mod identity;
mod restore;
#[cfg(test)]
mod tests;

use std::sync::Arc;

use serde::{Deserialize, Serialize};
use tracing::info;

pub use endpoint::serve as serve_endpoint;
pub use identity::Identity;
pub(super) use restore::{adopted, prepare_restore};

use super::evacuate::plan::{Candidate, estimate};
use super::host::Containers;
use super::{
    AnswerWhen, Caller, CheckpointError, CheckpointOutcome, CheckpointParams, EarlyAnswer, Engine,
    ProgressFn, Target, Workload,
};
use crate::criu::Enter;
use crate::store::PodInfo;

/// Where an opted-in container mounts the pod bundle (`scripts/pod-bundle.sh`): CRIU and
/// stasis-pod, runnable whatever the image holds.
pub const BUNDLE_MOUNT: &str = "/.stasis";

/// The container a workload runs in.
#[derive(Debug, Clone, Default, PartialEq, Eq, Serialize, Deserialize)]
pub struct ContainerRef {
    /// The runtime's container id.
    pub id: String,
    /// The container's init (stasis-pod), a pid of this host.
    pub init_pid: i32,
    /// The image it runs (its digest, or its reference where no digest is known).
    pub image: String,
    /// Its preStop hook's eviction is under way.
    #[serde(default)]
    pub evicting: bool,
    /// Its tree was evicted (checkpointed, then stopped): the pod is going away.
    #[serde(default)]
    pub evicted: bool,
    /// A checkpoint of another image may be restored into it (the pod says so).
    #[serde(default)]
    pub any_image: bool,
    /// The NVIDIA GPU device files it was given (`/dev/nvidia0`, ...), as the runtime
    /// reported them: a checkpoint of CUDA processes goes only into a container with as many.
    #[serde(default)]
    pub gpu_devices: Vec<String>,
}

/// What the NRI plugin reports of a container that opted in.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Registration {
    pub container: ContainerRef,
    pub identity: Identity,
    /// A checkpoint this often, left running (the pod's annotation), so that an eviction has
    /// little left to upload.
    pub checkpoint_every: Option<std::time::Duration>,
}

/// Why a pod request failed.
#[derive(Debug, thiserror::Error)]
pub enum PodError {
    #[error("{0}")]
    BadIdentity(String),
    #[error("process {0} (the container's init) is not running")]
    NoInit(i32),
    #[error(
        "container {0} shares its pod's process namespace (shareProcessNamespace): stasis needs \
         each opted-in container to have its own"
    )]
    SharedPids(String),
    #[error("the calling process belongs to no registered container (is the pod opted in?)")]
    UnknownCaller,
    #[error(
        "container {container}'s init has {children} children: its tree must be one command (the init's only child)"
    )]
    NotOneTree { container: String, children: usize },
    #[error("cannot record container {id}")]
    Registry {
        id: String,
        #[source]
        source: std::io::Error,
    },
}

impl Engine {
    /// Records a container (again): its workload, named by its identity, now runs there.
    /// Returns the workload's name.
    pub fn register_container(&self, r: Registration) -> Result<String, PodError> {
        let name = r.identity.workload_name().map_err(PodError::BadIdentity)?;
        if !self.deps.host.is_running(r.container.init_pid) {
            return Err(PodError::NoInit(r.container.init_pid));
        }
        // A restored tree is handed to its pid namespace's init, which must be stasis-pod.
        if !self.deps.host.is_namespace_init(r.container.init_pid) {
            return Err(PodError::SharedPids(r.container.id));
        }
        let (id, gpus) = (r.container.id.clone(), r.container.gpu_devices.clone());
        let every_ms = r.checkpoint_every.map(|d| d.as_millis() as u64);
        let registered = match self.registry.get(&name) {
            // A record root made for this container before (it restarted): it goes on.
            Some(w) if w.owner_uid == 0 => self.registry.update(&name, |w| {
                w.container = Some(r.container.clone());
                w.pid = 0;
                w.checkpoint_every_ms = every_ms;
            }),
            // A record of anyone else under this name inherits nothing: neither its owner nor
            // the policies that owner set.
            _ => self.registry.put(Workload {
                name: name.clone(),
                command: vec![format!("container {}", r.identity)],
                container: Some(r.container),
                checkpoint_every_ms: every_ms,
                ..Default::default()
            }),
        };

        registered.map_err(|source| PodError::Registry { id: id.clone(), source })?;
        info!(container = %id, workload = %name, ?gpus, "container registered");
        Ok(name)
    }

    /// Forgets container `id` (removed): its workload keeps its checkpoints.
    pub fn forget_container(&self, id: &str) {
        for w in self.registry.all().into_iter().filter(|w| w.container.as_ref().is_some_and(|c| c.id == id))
        {
            if let Err(e) = self.registry.update(&w.name, |w| w.container = None) {
                tracing::warn!(container = %id, error = %e, "cannot forget the container");
            }
        }
    }

    /// The workload of the registered container that process `pid` runs in (the same pid
    /// namespace as the container's init).
    fn container_of(&self, pid: i32) -> Option<Workload> {
        let host = &self.deps.host;
        let ns = host.pid_namespace(pid).ok()?;
        let ours = host.pid_namespace(std::process::id() as i32).ok()?;
        if ns == ours {
            return None;
        }
        self.registry
            .all()
            .into_iter()
            .find(|w| w.container.as_ref().is_some_and(|c| host.pid_namespace(c.init_pid).ok() == Some(ns)))
    }

    /// Whether workload `w`'s tree runs: its root, or for a container its init's one child.
    pub(super) fn tree_runs(&self, w: &Workload) -> bool {
        match &w.container {
            Some(c) => self.container_tree_root(w, c).is_ok(),
            None => self.deps.host.is_running(w.pid),
        }
    }

    /// The root of container workload `w`'s tree: its init's only child.
    pub(super) fn container_tree_root(&self, w: &Workload, c: &ContainerRef) -> Result<i32, PodError> {
        if !self.deps.host.is_running(c.init_pid) {
            return Err(PodError::NoInit(c.init_pid));
        }
        match self.deps.host.children(c.init_pid)[..] {
            [root] => Ok(root),
            ref other => Err(PodError::NotOneTree {
                container: format!("{} ({})", c.id, w.name),
                children: other.len(),
            }),
        }
    }

    /// What a checkpoint of container workload `name` (in `c`) records for a restore into
    /// another container: the identity, the image, the root's stdio and the pids inside.
    pub(super) fn pod_info(&self, name: &str, c: &ContainerRef, tree: &super::inspect::TreeInfo) -> PodInfo {
        let (host, root) = (&self.deps.host, tree.pids[0]);
        PodInfo {
            identity: name.to_owned(),
            image: c.image.clone(),
            stdio: (0..3).map(|fd| host.fd_target(root, fd).unwrap_or_default()).collect(),
            inner_pids: tree.pids.iter().map(|&p| host.pid_inside(p, c.init_pid).unwrap_or(0)).collect(),
            highest_inner_tid: tree
                .pids
                .iter()
                .flat_map(|&p| host.threads(p))
                .filter_map(|t| host.pid_inside(t, c.init_pid))
                .max()
                .unwrap_or(0),
        }
    }

    /// Evicts the tree of container workload `w`: checkpoints it, and kills it once the
    /// checkpoint is durable; on failure the tree runs on.
    ///
    /// With `within` (the time before the kubelet stops the container), an eviction not
    /// expected to be durable in time is refused before anything is touched: the job is then
    /// stopped as it would be without stasis, and its last checkpoint stays the newest.
    async fn evict_container(
        self: &Arc<Self>,
        w: Workload,
        within: Option<std::time::Duration>,
        progress: ProgressFn,
    ) -> Result<CheckpointOutcome, CheckpointError> {
        if let (Some(left), Some(c)) = (within, &w.container) {
            let root = self
                .container_tree_root(&w, c)
                .map_err(|source| CheckpointError::Container { workload: w.name.clone(), source })?;
            let resident = self.deps.host.resident_bytes(&self.deps.host.trees(&[root]));
            let candidate = Candidate { name: w.name.clone(), resident, last: w.last_cost };
            let needs = estimate(&candidate, super::now_unix_ms());
            if needs > left {
                return Err(CheckpointError::NoTime { workload: w.name, needs, left });
            }
        }
        self.mark_eviction(&w.name, true, false);
        // The hook returns once the checkpoint is durable; killing the stopped tree and the
        // rest of the job go on meanwhile (a restore of the workload waits for them).
        let (durable, answer) = tokio::sync::oneshot::channel();
        let engine = self.clone();
        let send = Box::new(move |outcome: CheckpointOutcome| {
            engine.mark_eviction(&outcome.workload, false, true);
            let _ = durable.send(outcome);
        });
        let params = CheckpointParams {
            target: Target::Workload(w.name.clone()),
            leave_running: false,
            answer_early: Some(EarlyAnswer { when: AnswerWhen::Durable, send }),
            reclaim: None,
            caller: Caller::Root,
        };
        let engine = self.clone();
        let job = tokio::spawn(async move {
            let evicted = engine.checkpoint(params, progress).await;
            if evicted.is_err() {
                engine.mark_eviction(&w.name, false, false);
            }
            evicted
        });
        match answer.await {
            Ok(outcome) => Ok(outcome),
            // The job ended before its checkpoint was durable: its error says why.
            Err(_) => job.await.map_err(CheckpointError::panicked("eviction"))?,
        }
    }

    fn mark_eviction(&self, name: &str, evicting: bool, evicted: bool) {
        let marked = self.registry.update(name, |w| {
            w.container.iter_mut().for_each(|c| (c.evicting, c.evicted) = (evicting, evicted));
        });
        if let Err(e) = marked {
            tracing::warn!(workload = %name, error = %e, "cannot record the eviction");
        }
    }
}

/// How CRIU enters container `c` (on `host`) to dump or restore its tree.
pub(super) fn enter(host: &dyn Containers, c: &ContainerRef, join_cgroups: bool) -> std::io::Result<Enter> {
    host.ensure_tmp(c.init_pid)?;
    let cgroups = match join_cgroups {
        true => host.cgroup_procs_files(c.init_pid)?,
        false => Vec::new(),
    };
    Ok(Enter { pid: c.init_pid, bundle: BUNDLE_MOUNT.into(), cgroups })
}
