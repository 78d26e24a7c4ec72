//! What a checkpoint holds of its tree between the GPU phase and the end of the job, and how
//! it gives it back when the job fails.
//!
//! Every exit of the job after the tree was touched goes through [`Hold`]: `release` when the
//! checkpoint is stored, `give_back` on failure. `give_back` undoes, in order: CRIU's TCP
//! repair mode and network lock (a failure after CRIU left an evicted tree stopped), the stop
//! itself (processes stopped before the checkpoint stay stopped), and the CUDA checkpoint.
//! A `Hold` dropped without either (a panic) still continues the tree's processes.

use std::path::Path;

use nix::sys::signal::Signal;
use tracing::{error, warn};

use super::super::gpu::Suspended;
use super::super::inspect::TreeInfo;
use super::super::sockets;
use super::super::{CheckpointError, Engine};
use super::held::HeldTree;

pub(super) struct Hold<'a> {
    engine: &'a Engine,
    tree: &'a TreeInfo,
    /// What a crashed stasisd's next start needs to give the tree back (`held.rs`).
    record: HeldTree,
    /// The dump's images: they name CRIU's network lock.
    images: &'a Path,
    /// Processes stopped before the checkpoint began: they stay stopped.
    stopped_before: Vec<i32>,
    /// The CUDA state moved into host memory, if any.
    gpu: Option<Suspended>,
    /// Whether the CUDA state is still in host memory (not yet put back).
    gpu_suspended: bool,
    settled: bool,
}

impl<'a> Hold<'a> {
    /// Takes hold of `tree` for checkpoint `id`; call before anything touches it.
    pub fn new(engine: &'a Engine, id: &str, tree: &'a TreeInfo, images: &'a Path) -> Hold<'a> {
        let stopped_before = engine.host.stopped(&tree.pids);
        let record = HeldTree::new(id, tree, &stopped_before, images);
        let hold = Hold {
            engine,
            tree,
            record,
            images,
            stopped_before,
            gpu: None,
            gpu_suspended: false,
            settled: false,
        };
        hold.save_record();
        hold
    }

    fn save_record(&self) {
        if let Err(e) = self.record.save(&self.engine.state.held_dir()) {
            warn!(checkpoint = %self.record.id, error = %e, "cannot record the held tree; a crash now would leave it held");
        }
    }

    /// Records the CUDA state the GPU phase moved into host memory.
    pub fn suspended_gpu(&mut self, gpu: Option<Suspended>) {
        self.gpu_suspended = gpu.is_some();
        self.record.gpu_pids = gpu.as_ref().map(|g| g.pids.clone()).unwrap_or_default();
        self.gpu = gpu;
        self.save_record();
    }

    /// What the GPU phase did (for the manifest).
    pub fn gpu(&self) -> Option<&Suspended> {
        self.gpu.as_ref()
    }

    /// The tree runs on after its dump (`--leave-running`, CRIU unlocked its connections):
    /// once its CUDA state is back, nothing of it is held any more, so a crash from here on
    /// must not have the next start settle it.
    pub async fn runs_again(&mut self) -> Result<u64, CheckpointError> {
        let took = self.resume_gpu().await?;
        HeldTree::clear(&self.engine.state.held_dir(), &self.record.id);
        Ok(took)
    }

    /// Puts the CUDA state back now; returns how long that took.
    async fn resume_gpu(&mut self) -> Result<u64, CheckpointError> {
        if !std::mem::take(&mut self.gpu_suspended) {
            return Ok(0);
        }
        self.engine.resume_gpu(&self.gpu).await
    }

    /// The checkpoint is stored: what is left is the job's to finish, which clears the record
    /// once the tree is settled (`HeldTree::clear`).
    pub fn release(mut self) {
        self.settled = true;
    }

    /// The checkpoint failed with `cause`: gives the tree back as it was, and returns `cause`
    /// with whatever could not be undone.
    pub async fn give_back(mut self, cause: CheckpointError) -> CheckpointError {
        self.settled = true;
        let mut problems = self.reopen_connections().await;
        self.continue_processes();
        if let Err(e) = self.resume_gpu().await {
            problems.push(crate::error_chain(&e));
        }
        for problem in &problems {
            warn!(problem = %problem, "rollback incomplete");
        }
        HeldTree::clear(&self.engine.state.held_dir(), &self.record.id);
        CheckpointError::with_rollback(cause, problems)
    }

    /// Takes the tree's connections out of CRIU's repair mode and removes its lock (nothing to
    /// do unless CRIU left the tree stopped after dumping it).
    async fn reopen_connections(&self) -> Vec<String> {
        let host = self.engine.host.clone();
        // Children forked since the tree was inspected were dumped (and stopped) too.
        let (pids, reuse) = (host.trees(&self.tree.pids), self.tree.sockets.reuse_addr.clone());
        let repaired = tokio::task::spawn_blocking(move || host.leave_repair(&pids, &reuse)).await;
        let (reopened, mut problems) =
            repaired.unwrap_or_else(|e| (Vec::new(), vec![format!("the connection rollback failed: {e}")]));
        let lock = self.tree.options.network_lock;
        problems.extend(sockets::unlock(&reopened, self.images, lock, &self.engine.reaper).await);
        problems
    }

    /// Continues every process of the tree that is stopped now but was not before.
    fn continue_processes(&self) {
        let host = &self.engine.host;
        let all = host.trees(&self.tree.pids);
        let stopped: Vec<i32> =
            host.stopped(&all).into_iter().filter(|p| !self.stopped_before.contains(p)).collect();
        host.signal(&stopped, Signal::SIGCONT);
    }
}

impl Drop for Hold<'_> {
    fn drop(&mut self) {
        if !self.settled {
            error!(pids = ?self.tree.pids, "checkpoint ended without settling its tree; continuing it");
            self.continue_processes();
        }
    }
}
