//! The dump of a tree that runs on (a checkpoint left running): frozen only while CRIU sends
//! its pages, stored once it runs again.
//!
//! A tree's first checkpoint here stages every page as it comes, in memory made ready before
//! the freeze, and hashes it afterwards: all of it is new, and hashing during the freeze would
//! only keep the tree frozen longer. A later one is sifted as it comes (`store::sift`): only
//! the chunks the store lacks are staged, so staging, and the memory made ready for it, scale
//! with what changed, not with the tree.

use std::path::Path;
use std::sync::Arc;

use super::dump::SPILL_FILE;
use super::rollback::Hold;
use super::store::DumpTiming;
use super::tracking::Tracking;
use super::{CheckpointStats, Job, OnResumed};
use crate::engine::inspect::TreeInfo;
use crate::engine::{CheckpointError, Engine, ProgressFn};
use crate::store::{DumpPages, ParentMemory, Staging};

/// What a dump left running is expected to stage.
enum Expected {
    /// Every page: the workload's first checkpoint here, of this many resident bytes.
    All(u64),
    /// About this many bytes of new chunks.
    New(u64),
}

impl Engine {
    /// Dumps a tree that runs on, and stores the checkpoint once it runs again.
    pub(super) async fn dump_left_running(
        &self,
        job: &Job,
        on_resumed: OnResumed,
        hold: &mut Hold<'_>,
        tree: &TreeInfo,
        images: &Path,
        progress: &ProgressFn,
    ) -> Result<CheckpointStats, CheckpointError> {
        let store_err = |source| CheckpointError::Store { id: job.id.clone(), source: Box::new(source) };
        self.begin_storing(&job.id, tree, images)?;
        let stored = async {
            // First: a sifted dump asks the store which chunks it holds while CRIU sends.
            let guard = self.deps.store.begin_commit().await.map_err(store_err)?;
            let tracking = self.begin_tracking(&job.workload, job.pid, tree, images);
            let (timing, pages) = match self.expected(&job.workload, tree) {
                Expected::All(resident) => {
                    // Staged whole: a first checkpoint here, which has no parent anyway.
                    let tracking = Tracking { parent: None, ..tracking };
                    self.dump_staged(job, tree, images, progress, resident, &tracking).await?
                }
                Expected::New(bytes) => {
                    self.dump_sifted(job, tree, images, progress, bytes, &tracking).await?
                }
            };
            let gpu_restore_ms = hold.runs_again().await?;
            job.resumed(&timing, on_resumed, progress);
            let dumped = job.dumped(tree, timing, hold, gpu_restore_ms);
            let stored = self.store_pages(pages, images, progress).await.map_err(store_err)?;
            // The next dump's parent, made before the commit takes the stored memory.
            let parent = tracking.on.then(|| ParentMemory::new(&job.id, &stored.memory));
            let stats = self.commit_checkpoint(dumped, &guard, stored).await.map_err(store_err)?;
            if let Some(memory) = parent {
                self.continue_chain(&job.workload, job.pid, tree, images, &job.id, memory);
            }
            Ok(stats)
        }
        .await;
        self.settle_store(&job.id, stored.is_ok());
        stored
    }

    /// Every page staged as CRIU sends it, into memory faulted in before the freeze.
    async fn dump_staged(
        &self,
        job: &Job,
        tree: &TreeInfo,
        images: &Path,
        progress: &ProgressFn,
        resident: u64,
        tracking: &Tracking,
    ) -> Result<(DumpTiming, DumpPages), CheckpointError> {
        let mut staging = Staging::new(&self.shared.staging, &images.join(SPILL_FILE));
        staging.reserve(resident);
        let (timing, staging) = self.dump_tree(job, tree, images, progress, staging, tracking).await?;
        let staged =
            staging.finish().map_err(|source| CheckpointError::Local { what: "page staging", source })?;
        Ok((timing, DumpPages::Staged(Arc::new(staged))))
    }

    /// The pages sifted as CRIU sends them, about `expected` bytes of staging made ready.
    async fn dump_sifted(
        &self,
        job: &Job,
        tree: &TreeInfo,
        images: &Path,
        progress: &ProgressFn,
        expected: u64,
        tracking: &Tracking,
    ) -> Result<(DumpTiming, DumpPages), CheckpointError> {
        let local = |what| move |source| CheckpointError::Local { what, source };
        let spill = images.join(SPILL_FILE);
        let parent = tracking.store_parent(self);
        let (sink, sifting) = self
            .deps
            .store
            .sift(&self.shared.staging, &spill, &self.shared.blocks, expected, parent)
            .map_err(local("page sifting"))?;
        let sink = tracking.reading_tree(self, tree, sink);
        let dumped = self.dump_tree(job, tree, images, progress, sink, tracking).await;
        // The sifting thread ends once the sink is finished or dropped (a failed dump).
        let (timing, sink) = match dumped {
            Ok(dumped) => dumped,
            Err(e) => {
                let _ = tokio::task::spawn_blocking(move || sifting.finish()).await;
                return Err(e);
            }
        };
        sink.finish().map_err(local("page stream"))?;
        let sifted = tokio::task::spawn_blocking(move || sifting.finish())
            .await
            .map_err(CheckpointError::panicked("sifting thread"))?
            .map_err(local("page sifting"))?;
        Ok((timing, DumpPages::Sifted(Box::new(sifted))))
    }

    /// What a dump of `tree` left running will stage, to be made ready before the freeze: all
    /// of it for the workload's first checkpoint here; what the last one found new when that
    /// one followed another; none after a first checkpoint, whose delta says nothing of the
    /// next (new chunks are then faulted in as they come, about 0.8 ms per MiB of frozen time
    /// on a small cloud VM).
    fn expected(&self, workload: &str, tree: &TreeInfo) -> Expected {
        let resident = || self.deps.host.resident_bytes(&tree.pids);
        match self.registry.get(workload).and_then(|w| w.last_cost) {
            None => Expected::All(resident()),
            Some(last) if last.since_previous_ms.is_some() => Expected::New(last.bytes_new.min(resident())),
            Some(_) => Expected::New(0),
        }
    }
}
