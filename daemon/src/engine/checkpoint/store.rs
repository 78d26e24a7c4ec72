//! Storing a dumped tree: its pages and images into the store, then the manifest (the commit),
//! and the conversions between the engine's CRIU options and the manifest's.

use std::path::Path;
use std::sync::Arc;
use std::time::Instant;

use stasis_proto::stasis::store::v1::DumpOptions;
use tracing::{info, warn};

use super::super::gpu::Suspended;
use super::super::ids::ms;
use super::super::inspect::TreeInfo;
use super::super::{CheckpointError, Engine, ProgressFn, ProgressUpdate};
use super::CheckpointStats;
use super::dump::SPILL_FILE;
use crate::criu::{LOG_FILE, NetworkLock, TreeOptions};
use crate::engine::access::owner_of;
use crate::store::{CommitGuard, DumpPages, Manifest, StoreError, StoredDump};

/// A tree CRIU has dumped, about to be stored as checkpoint `id`.
pub(super) struct Dumped<'a> {
    pub id: &'a str,
    pub workload: &'a str,
    pub tree: &'a TreeInfo,
    pub created_unix_ms: u64,
    pub timing: DumpTiming,
    /// What the GPU phase did, and how long putting the CUDA state back took (tree run on).
    pub gpu: Option<&'a Suspended>,
    pub gpu_restore_ms: u64,
}

/// When the job started and the dump ended, and how long CRIU kept the tree frozen.
pub(super) struct DumpTiming {
    pub started: Instant,
    pub dump_done: Instant,
    pub frozen_ms: u64,
}

impl Engine {
    /// Marks checkpoint `id` in flight (its packs are not orphans while it is) and puts the
    /// tree's stasis-init among its images. Every call is followed by [`Self::settle_store`].
    pub(super) fn begin_storing(
        &self,
        id: &str,
        tree: &TreeInfo,
        images: &Path,
    ) -> Result<(), CheckpointError> {
        self.deps
            .state
            .mark_inflight(id)
            .map_err(|source| CheckpointError::Local { what: "in-flight marker", source })?;
        // The tree's stasis-init travels with it (see `linux::init_program`).
        if let Some((exe, name)) =
            tree.init_program.as_ref().and_then(|e| Some((e, crate::linux::init_program::name_of(e)?)))
        {
            std::fs::copy(exe, images.join(name)).map_err(|source| {
                self.settle_store(id, false);
                CheckpointError::Local { what: "copy of the tree's stasis-init", source }
            })?;
        }
        Ok(())
    }

    /// Stores the pages, then the image files (CRIU's, without its log and the spill file);
    /// under a commit guard the caller holds.
    pub(super) async fn store_pages(
        &self,
        pages: DumpPages,
        images: &Path,
        progress: &ProgressFn,
    ) -> Result<StoredDump, StoreError> {
        let report: crate::store::Progress = {
            let progress = progress.clone();
            Arc::new(move |done, total| progress(ProgressUpdate { phase: "upload", done, total }))
        };
        self.deps.store.store_dump(pages, images, &[LOG_FILE, SPILL_FILE], report).await
    }

    /// Commits the manifest of a stored dump.
    pub(super) async fn commit_checkpoint(
        &self,
        dumped: Dumped<'_>,
        guard: &CommitGuard,
        stored: StoredDump,
    ) -> Result<CheckpointStats, StoreError> {
        let stats = stats(&dumped, &stored);
        self.deps.store.commit(&self.manifest(&dumped, stored, stats), guard).await?;
        Ok(stats)
    }

    /// Ends what [`Self::begin_storing`] began: the marker goes, and after a failure so does
    /// what the attempt uploaded.
    pub(super) fn settle_store(&self, id: &str, committed: bool) {
        match committed {
            true => self.deps.state.clear_inflight(id),
            false => self.remove_orphans(id),
        }
    }

    /// Removes what a failed upload left in the store (this node's unreferenced packs), so
    /// a store that ran full has room again soon rather than after the GC grace period. In the
    /// background: the collection waits for other uploads' commit guards, and the failed job's
    /// tree must not wait for it.
    fn remove_orphans(&self, id: &str) {
        let (store, state, grace, id) =
            (self.deps.store.clone(), self.deps.state.clone(), self.settings.gc_grace, id.to_string());
        tokio::spawn(async move {
            match store.gc(None, grace, true, std::time::Duration::from_secs(60)).await {
                Ok(report) => {
                    info!(checkpoint = %id, packs = report.packs_deleted, "removed what the failed upload left");
                    state.clear_inflight(&id);
                }
                Err(e) => {
                    warn!(checkpoint = %id, error = %e, "cannot remove what the failed upload left; the next start retries")
                }
            }
        });
    }

    /// The manifest of a stored dump.
    fn manifest(&self, d: &Dumped<'_>, stored: StoredDump, stats: CheckpointStats) -> Manifest {
        let gpu = d.gpu;
        let record = self.registry.get(d.workload).unwrap_or_default();
        Manifest {
            id: d.id.into(),
            workload: d.workload.into(),
            created_unix_ms: d.created_unix_ms,
            node: self.deps.host.node_name(),
            kernel: self.deps.host.kernel_release(),
            criu_version: self.support.version.to_string(),
            root_pid: d.tree.pids[0],
            pids: d.tree.pids.clone(),
            command: d.tree.command.clone(),
            options: Some(dump_options(&d.tree.options)),
            parent_id: record.last_checkpoint.unwrap_or_default(),
            files: stored.files,
            memory: stored.memory,
            gpu_pids: gpu.map(|g| g.pids.clone()).unwrap_or_default(),
            gpus: gpu.map(|g| g.devices.clone()).unwrap_or_default(),
            gpu_host_memory: gpu.map(|g| g.host_memory.clone()).unwrap_or_default(),
            cuda_driver: gpu.map(|g| g.driver_version).unwrap_or_default(),
            stats: Some(stats),
            sockets: d.tree.sockets.records.clone(),
            owner_uid: owner_of(&d.tree.uids),
            cpu_flags: self.deps.host.cpu_flags().into_iter().collect(),
            own_pid_namespace: !d.tree.ns_pids.is_empty(),
            ns_pids: d.tree.ns_pids.clone(),
            log_file: (record.log_path)
                .filter(|log| d.tree.open_files.contains(log))
                .map(|log| log.display().to_string())
                .unwrap_or_default(),
            cgroup: (record.cgroup.as_deref())
                .and_then(|c| self.deps.host.cgroup_in_hierarchy(c))
                .unwrap_or_default(),
            init_dir: d.tree.init_dir.as_ref().map(|dir| dir.display().to_string()).unwrap_or_default(),
            archive: None,
            pod: record.container.as_ref().map(|c| self.pod_info(d.workload, c, d.tree)),
        }
    }
}

/// The stats of a stored dump, as of now.
fn stats(d: &Dumped<'_>, stored: &StoredDump) -> CheckpointStats {
    let (timing, gpu) = (&d.timing, d.gpu);
    CheckpointStats {
        frozen_ms: timing.frozen_ms,
        total_ms: ms(timing.started.elapsed()),
        durable_ms: ms(timing.started.elapsed()),
        bytes_total: stored.chunks.bytes_total,
        bytes_uploaded: stored.bytes_uploaded,
        chunks_total: stored.chunks.chunks_total,
        chunks_new: stored.chunks.chunks_new,
        chunks_zero: stored.chunks.chunks_zero,
        bytes_unchanged: stored.chunks.bytes_unchanged,
        bytes_from_tree: stored.chunks.bytes_from_tree,
        bytes_in_part: stored.chunks.bytes_in_part,
        gpu_lock_ms: gpu.map(|g| g.times.lock_ms).unwrap_or_default(),
        gpu_checkpoint_ms: gpu.map(|g| g.times.checkpoint_ms).unwrap_or_default(),
        gpu_restore_ms: d.gpu_restore_ms,
        gpu_bytes: gpu.map(|g| g.bytes).unwrap_or_default(),
        dump_ms: ms(timing.dump_done - timing.started),
        store_ms: ms(timing.dump_done.elapsed()),
    }
}

fn dump_options(t: &TreeOptions) -> DumpOptions {
    DumpOptions {
        shell_job: t.shell_job,
        tcp_established: t.tcp_established,
        ext_unix_sk: t.ext_unix_sk,
        file_locks: t.file_locks,
        external: t.external.clone(),
        link_remap: t.link_remap,
        network_lock: t.network_lock.map(|l| l.name().to_string()).unwrap_or_default(),
    }
}

pub(in crate::engine) fn tree_options(d: &DumpOptions) -> TreeOptions {
    TreeOptions {
        shell_job: d.shell_job,
        tcp_established: d.tcp_established,
        ext_unix_sk: d.ext_unix_sk,
        file_locks: d.file_locks,
        external: d.external.clone(),
        link_remap: d.link_remap,
        network_lock: NetworkLock::from_name(&d.network_lock),
    }
}
