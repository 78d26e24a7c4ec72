//! What is checked before anything is restored: the node (or container) can take the
//! checkpoint, and where its GPU state goes.

use std::time::Duration;

use tracing::warn;

use crate::cuda::GpuUuid;
use crate::engine::pods::ContainerRef;
use crate::engine::sockets::{self, needs_network_support};
use crate::engine::{Engine, RestoreError, compat, gpu::GpuError, gpu_map};
use crate::store::Manifest;

/// How long to wait for the checkpointed tree's old processes to be reaped.
const PIDS_FREE_WAIT: Duration = Duration::from_secs(3);

impl Engine {
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

    /// Where the checkpoint's GPU state goes on this node, among the GPUs the container whose
    /// init is `container_init` was given if it goes into one; refuses an incompatible target
    /// before anything is restored.
    pub(super) async fn place_gpus(
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
}

/// What [`Engine::preflight`] found.
pub(super) struct Preflight {
    /// What the restored tree will notice (see `sockets::check_restore`).
    pub(super) warnings: Vec<String>,
    /// Where its GPU state goes: (checkpoint GPU, this node's GPU).
    pub(super) gpu_pairs: Vec<(GpuUuid, GpuUuid)>,
}
