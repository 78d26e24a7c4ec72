//! What a checkpoint holds of its tree between the GPU phase and the end of the job, and how
//! it gives it back when the job fails.
//!
//! Every exit of the job after the tree was touched goes through [`Hold`]: `release` when the
//! checkpoint is stored, `give_back` on failure. `give_back` undoes, in order: CRIU's TCP
//! repair mode and network lock (a failure after CRIU left an evicted tree stopped), the stop
//! itself (processes stopped before the checkpoint stay stopped), and the CUDA checkpoint.
//! A `Hold` dropped without either (a panic) still continues the tree's processes.

use std::collections::HashSet;
use std::path::Path;

use nix::sys::signal::Signal;
use tracing::{error, warn};

use super::super::gpu::Suspended;
use super::super::inspect::TreeInfo;
use super::super::sockets;
use super::super::{CheckpointError, Engine};
use super::crash_record::HeldTree;
use crate::criu::NetworkLock;

pub(super) struct Hold<'a> {
    engine: &'a Engine,
    tree: &'a TreeInfo,
    /// What a crashed stasisd's next start needs to give the tree back (`crash_record.rs`).
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
    pub fn new(
        engine: &'a Engine,
        id: &str,
        tree: &'a TreeInfo,
        images: &'a Path,
        container_init: Option<i32>,
    ) -> Hold<'a> {
        let stopped_before = engine.deps.host.stopped(&tree.pids);
        let record = HeldTree::new(id, tree, &stopped_before, images, container_init);
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
        if let Err(e) = self.record.save(&self.engine.deps.state.held_dir()) {
            warn!(checkpoint = %self.record.id, error = %e, "cannot record the held tree; a crash now would leave it held");
        }
    }

    /// Takes on the CUDA state the GPU phase moved into host memory.
    pub fn suspended_gpu(&mut self, gpu: Option<Suspended>) {
        self.gpu_suspended = gpu.is_some();
        self.gpu = gpu;
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
        HeldTree::clear(&self.engine.deps.state.held_dir(), &self.record.id);
        Ok(took)
    }

    /// Puts the CUDA state back now; returns how long that took.
    async fn resume_gpu(&mut self) -> Result<u64, CheckpointError> {
        let pids = self.suspended_pids();
        self.gpu_suspended = false;
        self.engine.resume_gpu(self.record.container_init, &pids).await
    }

    /// The processes whose CUDA state is still in host memory.
    fn suspended_pids(&self) -> Vec<i32> {
        match (self.gpu_suspended, &self.gpu) {
            (true, Some(gpu)) => gpu.pids.clone(),
            _ => Vec::new(),
        }
    }

    /// The checkpoint is stored: what is left is the job's to finish, which clears the record
    /// once the tree is settled (`HeldTree::clear`).
    pub fn release(mut self) {
        self.settled = true;
    }

    /// The checkpoint failed with `cause`: gives the tree back as it was, and returns `cause`
    /// with whatever could not be undone.
    /// A dump whose processes died with it says so instead of claiming they run on.
    pub async fn give_back(self, cause: CheckpointError) -> CheckpointError {
        let (engine, tree) = (self.engine, self.tree);
        let problems = self.resume().await;
        let cause = match cause {
            CheckpointError::Dump { workload, source } if engine.tree_now(tree).is_empty() => {
                error!(workload = %workload, pids = ?tree.pids, error = %source, "the workload died during its failed dump");
                CheckpointError::Lost { workload, source }
            }
            other => other,
        };
        CheckpointError::with_rollback(cause, problems)
    }

    /// Gives the tree back as it was (its checkpoint failed, or is stored but the tree is to
    /// run on); returns what could not be undone.
    pub async fn resume(mut self) -> Vec<String> {
        self.settled = true;
        // Children forked since the tree was inspected were dumped (and stopped) too.
        let tree = HeldProcesses {
            pids: self.engine.tree_now(self.tree),
            stopped_before: &self.stopped_before,
            reuse_addr: &self.tree.sockets.reuse_addr,
            images: self.images,
            lock: self.tree.options.network_lock,
            gpu_pids: self.suspended_pids(),
            container_init: self.record.container_init,
        };
        self.gpu_suspended = false;
        let problems = self.engine.give_tree_back(tree).await;
        for problem in &problems {
            warn!(problem = %problem, "rollback incomplete");
        }
        HeldTree::clear(&self.engine.deps.state.held_dir(), &self.record.id);
        problems
    }
}

/// The processes of a tree a checkpoint touched, and what it did to them.
pub(super) struct HeldProcesses<'a> {
    /// Every process of the tree.
    pub pids: Vec<i32>,
    /// Those stopped before the checkpoint: they stay stopped.
    pub stopped_before: &'a [i32],
    /// Inodes of connections with `SO_REUSEADDR` set.
    pub reuse_addr: &'a HashSet<u64>,
    /// The dump's images: they name CRIU's network lock.
    pub images: &'a Path,
    pub lock: Option<NetworkLock>,
    /// Those whose CUDA state is in host memory.
    pub gpu_pids: Vec<i32>,
    /// The init of the container the tree runs in, if it does.
    pub container_init: Option<i32>,
}

impl Engine {
    /// Gives a tree back as it was before a checkpoint touched it, in order: its connections
    /// out of CRIU's repair mode and lock (nothing to do unless CRIU left the tree stopped after
    /// dumping it), its processes continued, its CUDA state put back. Returns what could not
    /// be undone.
    pub(super) async fn give_tree_back(&self, tree: HeldProcesses<'_>) -> Vec<String> {
        let (host, pids, reuse) = (self.deps.host.clone(), tree.pids.clone(), tree.reuse_addr.clone());
        let repaired = tokio::task::spawn_blocking(move || host.leave_repair(&pids, &reuse)).await;
        let (reopened, mut problems) =
            repaired.unwrap_or_else(|e| (Vec::new(), vec![format!("the connection rollback failed: {e}")]));
        problems.extend(
            sockets::unlock(&self.deps.host, &self.deps.reaper, &reopened, tree.images, tree.lock).await,
        );
        self.continue_stopped(&tree.pids, tree.stopped_before);
        if let Err(e) = self.resume_gpu(tree.container_init, &tree.gpu_pids).await {
            problems.push(crate::error_chain(&e));
        }
        problems
    }

    /// Continues every process of `pids` that is stopped now but was not `before`.
    fn continue_stopped(&self, pids: &[i32], before: &[i32]) {
        let stopped: Vec<i32> =
            self.deps.host.stopped(pids).into_iter().filter(|p| !before.contains(p)).collect();
        self.deps.host.signal(&stopped, Signal::SIGCONT);
    }
}

impl Drop for Hold<'_> {
    fn drop(&mut self) {
        if !self.settled {
            error!(pids = ?self.tree.pids, "checkpoint ended without settling its tree; continuing it");
            self.engine.continue_stopped(&self.engine.deps.host.trees(&self.tree.pids), &self.stopped_before);
        }
    }
}
