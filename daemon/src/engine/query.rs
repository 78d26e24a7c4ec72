//! Read-only and bookkeeping operations: list, show, delete, status.

use super::checkpoint::tracking_report;
use super::ids::valid_checkpoint_id;
use super::{Caller, Engine, IdleState, QueryError, Workload};
use crate::criu::images::{pagemap_file_name, pages_file_name};
use crate::store::Manifest;
use crate::store::{CheckReport, GcReport, Retention};

/// A stored checkpoint as the API shows it.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct CheckpointSummary {
    pub id: String,
    pub workload: String,
    pub pid: i32,
    pub pids: Vec<i32>,
    pub created_unix_ms: u64,
    pub bytes_total: u64,
    pub node: String,
    pub kernel: String,
    pub criu_version: String,
    pub command: Vec<String>,
    pub files: Vec<String>,
    pub criu_options: Vec<String>,
    /// The tree's sockets, one line each.
    pub sockets: Vec<String>,
    pub stats: super::CheckpointStats,
    /// For an imported checkpoint, what archive it came from.
    pub imported_from: String,
}

impl From<&Manifest> for CheckpointSummary {
    fn from(m: &Manifest) -> Self {
        Self {
            id: m.id.clone(),
            workload: m.workload.clone(),
            pid: m.root_pid,
            pids: m.pids.clone(),
            created_unix_ms: m.created_unix_ms,
            bytes_total: m.stats.map(|s| s.bytes_total).unwrap_or_default(),
            node: m.node.clone(),
            kernel: m.kernel.clone(),
            criu_version: m.criu_version.clone(),
            command: m.command.clone(),
            files: image_names(m),
            criu_options: super::checkpoint::tree_options(&m.options.clone().unwrap_or_default()).describe(),
            sockets: m.sockets.iter().map(super::sockets::describe).collect(),
            stats: m.stats.unwrap_or_default(),
            imported_from: m.archive.as_ref().map(imported_from).unwrap_or_default(),
        }
    }
}

/// What an imported checkpoint's archive was: its engine, container and image.
fn imported_from(a: &stasis_proto::stasis::store::v1::ArchiveInfo) -> String {
    let details: Vec<String> = [("container", &a.container), ("image", &a.image)]
        .into_iter()
        .filter(|(_, v)| !v.is_empty())
        .map(|(k, v)| format!("{k} {v}"))
        .collect();
    match details.is_empty() {
        true => format!("{} archive", a.engine),
        false => format!("{} archive ({})", a.engine, details.join(", ")),
    }
}

/// The image files a restore of `m` writes: CRIU's own images, then each memory image's
/// pagemap and pages files.
fn image_names(m: &Manifest) -> Vec<String> {
    let mut names: Vec<String> = m.files.iter().map(|f| f.name.clone()).collect();
    for (i, image) in m.memory.iter().enumerate() {
        names.extend(pagemap_file_name(image.dst_id));
        names.push(pages_file_name(i as u32 + 1));
    }
    names
}

/// The checkpoints in the store (of a workload), and those whose manifest cannot be read
/// ("ID: why"; their workload is unknown, so they are listed whatever the filter).
#[derive(Debug, Clone, Default)]
pub struct CheckpointList {
    pub checkpoints: Vec<CheckpointSummary>,
    pub unreadable: Vec<String>,
}

/// The daemon's state for `stasis status`.
#[derive(Debug, Clone)]
pub struct StatusReport {
    pub daemon_version: String,
    pub criu_version: String,
    pub criu_path: String,
    pub kernel: String,
    pub gpu_support: String,
    pub store_url: String,
    pub state_dir: String,
    /// "supported", or why this CRIU cannot dump inet sockets on this kernel.
    pub socket_support: String,
    /// The network lock in use, or "none (why)".
    pub network_lock: String,
    /// "on (soft-dirty, ...)", or "off (why)" (`checkpoint::tracking_report`).
    pub memory_tracking: String,
    /// How new chunks are compressed.
    pub compression: String,
    pub workloads: Vec<WorkloadReport>,
}

/// A workload as `status` shows it.
#[derive(Debug, Clone)]
pub struct WorkloadReport {
    pub workload: Workload,
    /// Whether it runs now.
    pub running: bool,
    /// Where it stands with idle reclaim.
    pub idle: IdleState,
    /// Its periodic interval as shortened to fit the notice window (see `evacuate`), if it is.
    pub fitted_every: Option<std::time::Duration>,
}

/// How long a collection waits for other nodes' commits and restores under way.
const GC_WAIT: std::time::Duration = std::time::Duration::from_secs(60);

impl Engine {
    /// Checkpoints in the store, oldest first, optionally of one workload only.
    /// A caller other than root sees its own checkpoints only (and no unreadable ones).
    pub async fn list(&self, workload: Option<&str>, caller: Caller) -> Result<CheckpointList, QueryError> {
        let listing = self.deps.store.listing().await?;
        let checkpoints = listing
            .manifests
            .iter()
            .filter(|m| workload.is_none_or(|w| m.workload == w) && caller.owns(m.owner_uid))
            .map(CheckpointSummary::from)
            .collect();
        let unreadable = match caller {
            Caller::Root => listing.unreadable.into_iter().map(|(id, why)| format!("{id}: {why}")).collect(),
            Caller::User { .. } => Vec::new(),
        };
        Ok(CheckpointList { checkpoints, unreadable })
    }

    /// One checkpoint, its manifest verified.
    pub async fn show(&self, id: &str, caller: Caller) -> Result<CheckpointSummary, QueryError> {
        Ok(CheckpointSummary::from(&self.own_manifest(id, caller).await?))
    }

    /// Manifest `id`, verified, if `caller` may see it.
    async fn own_manifest(&self, id: &str, caller: Caller) -> Result<Manifest, QueryError> {
        if !valid_checkpoint_id(id) {
            return Err(QueryError::BadId(id.into()));
        }
        let manifest = self.deps.store.manifest(id).await?;
        if !caller.owns(manifest.owner_uid) {
            return Err(QueryError::NotYours(id.into()));
        }
        Ok(manifest)
    }

    /// Deletes a checkpoint: its manifest first, then its data.
    pub async fn delete(&self, id: &str, caller: Caller) -> Result<(), QueryError> {
        if caller != Caller::Root {
            self.own_manifest(id, caller).await?;
        } else if !valid_checkpoint_id(id) {
            return Err(QueryError::BadId(id.into()));
        }
        let waiting = self
            .registry
            .all()
            .into_iter()
            .find(|w| w.reclaimed.as_ref().is_some_and(|r| r.checkpoint == id));
        if let Some(w) = waiting {
            return Err(QueryError::Reclaimed { id: id.into(), workload: w.name });
        }
        self.deps.store.delete(id).await?;
        tracing::info!(checkpoint = %id, "checkpoint deleted");
        Ok(())
    }

    /// Applies `keep_last` (if any) and reclaims unreferenced store space.
    /// Root's alone: it deletes the checkpoints of every user.
    pub async fn gc(&self, keep_last: Option<usize>, caller: Caller) -> Result<GcReport, QueryError> {
        if caller != Caller::Root {
            return Err(QueryError::RootOnly("garbage collection"));
        }
        let retention = keep_last.map(|keep_last| Retention { keep_last });
        Ok(self.deps.store.gc(retention, self.settings.gc_grace, false, GC_WAIT).await?)
    }

    /// Verifies the store (root's alone: it reads every user's checkpoints).
    pub async fn check(&self, read_data: bool, caller: Caller) -> Result<CheckReport, QueryError> {
        if caller != Caller::Root {
            return Err(QueryError::RootOnly("checking the store"));
        }
        Ok(self.deps.store.check(read_data).await?)
    }

    /// The retention policy, run after each checkpoint; failures are logged, not returned:
    /// the checkpoint itself is stored. It does not wait for other nodes' commits (the
    /// checkpoint's caller would wait with it): busy now, it runs after the next checkpoint.
    pub(super) async fn apply_retention(&self) {
        // During an evacuation the evictions need the store to themselves.
        let Some(keep_last) = self.settings.keep_last.filter(|_| !self.is_evacuating()) else { return };
        let retention = Some(Retention { keep_last });
        if let Err(e) =
            self.deps.store.gc(retention, self.settings.gc_grace, false, std::time::Duration::ZERO).await
        {
            tracing::warn!(error = %e, "retention policy failed; the next checkpoint retries");
        }
    }

    /// The daemon's state, and the workloads `caller` owns.
    pub fn status(&self, caller: Caller) -> StatusReport {
        StatusReport {
            daemon_version: env!("CARGO_PKG_VERSION").into(),
            criu_version: self.support.version.to_string(),
            criu_path: self.deps.criu.path().display().to_string(),
            kernel: self.deps.host.kernel_release(),
            gpu_support: match &self.deps.gpu {
                Some(gpu) => match gpu.gpus() {
                    Ok(gpus) => format!(
                        "available: CUDA {} driver API, {} GPU(s){}",
                        crate::cuda::format_driver_version(gpu.driver_version()),
                        gpus.len(),
                        gpus.first().map(|g| format!(" ({})", g.name)).unwrap_or_default()
                    ),
                    Err(e) => format!("driver loaded, GPUs not listable: {e}"),
                },
                None => "unavailable: no NVIDIA driver (CPU-only trees are checkpointed)".into(),
            },
            store_url: self.deps.store.url().into(),
            state_dir: self.deps.state.root().display().to_string(),
            socket_support: match &self.support.network_sockets {
                Ok(()) => "supported (TCP, UDP, Unix, packet and netlink sockets)".into(),
                Err(why) => format!("network sockets unsupported: {why}"),
            },
            network_lock: match &self.support.network_lock {
                Ok(lock) => lock.name().into(),
                Err(why) => format!("none ({why}); trees with established TCP connections are refused"),
            },
            memory_tracking: tracking_report(
                &self.support.memory_tracking,
                self.deps.host.huge_pages_mode().as_deref(),
            ),
            compression: self.deps.store.compression().to_string(),
            workloads: self
                .registry
                .all()
                .into_iter()
                .filter(|w| caller.owns(w.owner_uid))
                .map(|w| WorkloadReport {
                    running: w.reclaimed.is_none() && self.tree_runs(&w),
                    idle: self.idle_state(&w),
                    fitted_every: self.workloads.read(&w.name, |slot| slot.periodic.fitted).flatten(),
                    workload: w,
                })
                .collect(),
        }
    }
}
