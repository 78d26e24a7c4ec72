//! The record of a tree a checkpoint holds, for the case stasisd dies holding it.
//!
//! From before the GPU phase until the job has settled the tree (resumed it, or killed it
//! after an eviction committed), `<state>/held/<id>.json` says which processes it holds (by
//! pid and start time, so a reused pid is never touched), which were stopped before, and where
//! CRIU's images (naming its network lock) are. Which of them use CUDA is not recorded: a
//! crash inside the GPU phase would come before the record could say, so the next start asks
//! the driver about every process with CUDA loaded. The next start of stasisd settles every
//! tree a record names:
//!
//! - the checkpoint committed (its manifest exists): the eviction is completed, the tree killed;
//! - otherwise the tree is given back: connections out of repair mode and unlocked, stopped
//!   processes continued, CUDA state put back.
//!
//! Either way a workload never stays stopped, and never ends up both gone and uncheckpointed.

use std::collections::HashSet;
use std::path::{Path, PathBuf};

use nix::sys::signal::Signal;
use serde::{Deserialize, Serialize};
use tracing::{info, warn};

use super::super::Engine;
use super::super::host::Host;
use super::super::inspect::TreeInfo;
use super::rollback::HeldProcesses;
use crate::criu::NetworkLock;
use crate::store::StoreError;

/// How long the next start waits for a crashed stasisd's CRIU to let go of a tree.
const CRIU_LETS_GO: std::time::Duration = std::time::Duration::from_secs(60);

/// What a checkpoint job holds of its tree.
#[derive(Debug, Clone, Serialize, Deserialize, PartialEq, Eq)]
pub(super) struct HeldTree {
    pub id: String,
    /// (pid, start time) of every process of the tree.
    pub processes: Vec<(i32, u64)>,
    pub stopped_before: Vec<i32>,
    /// CRIU's images directory of the job.
    pub images: PathBuf,
    pub network_lock: Option<String>,
    pub reuse_addr: Vec<u64>,
    /// The init of the container the tree runs in (a Kubernetes container's): its CUDA state
    /// is reached inside it.
    #[serde(default)]
    pub container_init: Option<i32>,
}

impl HeldTree {
    pub fn new(
        id: &str,
        tree: &TreeInfo,
        stopped_before: &[i32],
        images: &Path,
        container_init: Option<i32>,
    ) -> HeldTree {
        let processes = tree.pids.iter().filter_map(|pid| Some((*pid, *tree.started.get(pid)?))).collect();
        HeldTree {
            id: id.into(),
            processes,
            stopped_before: stopped_before.to_vec(),
            images: images.to_path_buf(),
            network_lock: tree.options.network_lock.map(|l| l.name().into()),
            reuse_addr: tree.sockets.reuse_addr.iter().copied().collect(),
            container_init,
        }
    }

    fn path(dir: &Path, id: &str) -> PathBuf {
        dir.join(format!("{id}.json"))
    }

    /// Writes the record into `dir` (the state directory's `held/`).
    pub fn save(&self, dir: &Path) -> std::io::Result<()> {
        let json = serde_json::to_vec(self).map_err(std::io::Error::other)?;
        crate::linux::durable_file::replace(&Self::path(dir, &self.id), &json)
    }

    pub fn clear(dir: &Path, id: &str) {
        let _ = std::fs::remove_file(Self::path(dir, id));
    }

    /// The records in `dir`, with those that cannot be read named for the log.
    fn all(dir: &Path) -> Vec<Result<HeldTree, String>> {
        let Ok(entries) = std::fs::read_dir(dir) else { return Vec::new() };
        entries
            .flatten()
            // Staging files of a replace a crash cut short: the records are whole.
            .filter(|e| e.path().extension().is_some_and(|x| x == "json"))
            .map(|e| {
                let text = std::fs::read(e.path()).map_err(|err| format!("{}: {err}", e.path().display()))?;
                serde_json::from_slice(&text).map_err(|err| format!("{}: {err}", e.path().display()))
            })
            .collect()
    }

    /// The recorded processes that still exist (on `host`) as the same processes.
    fn alive(&self, host: &dyn Host) -> Vec<i32> {
        self.processes
            .iter()
            .filter(|(pid, start)| host.still_running(*pid, *start))
            .map(|(pid, _)| *pid)
            .collect()
    }
}

impl Engine {
    /// Settles the trees a crashed stasisd held (see the module's documentation). Runs at
    /// start, before work directories are cleared.
    pub(in crate::engine) async fn recover_held(&self) {
        let dir = self.deps.state.held_dir();
        for record in HeldTree::all(&dir) {
            let held = match record {
                Ok(held) => held,
                Err(why) => {
                    warn!(record = %why, "unreadable record of a held tree; removing it");
                    continue;
                }
            };
            self.settle(&held).await;
            HeldTree::clear(&dir, &held.id);
        }
        // Unreadable records too: nothing can be done with them.
        let _ = std::fs::remove_dir_all(&dir).and_then(|()| std::fs::create_dir_all(&dir));
    }

    async fn settle(&self, held: &HeldTree) {
        // The CRIU of the crashed stasisd may still be at work on the tree: left alone, it
        // gives the tree back itself once its connection is gone (or dumps it to the end).
        // Settling the tree under it would fail (CUDA's restore of a traced process does),
        // so wait for it to let go first.
        let deadline = std::time::Instant::now() + CRIU_LETS_GO;
        while !self.deps.host.traced(&held.alive(self.deps.host.as_ref())).is_empty() {
            if std::time::Instant::now() >= deadline {
                warn!(checkpoint = %held.id, "the tree is still traced; settling it all the same");
                break;
            }
            tokio::time::sleep(std::time::Duration::from_millis(100)).await;
        }
        let pids = held.alive(self.deps.host.as_ref());
        if pids.is_empty() {
            return;
        }
        match self.deps.store.manifest(&held.id).await {
            Ok(_) => {
                info!(checkpoint = %held.id, ?pids, "completing an eviction a crash interrupted: killing the tree");
                self.deps.host.signal(&self.deps.host.trees(&pids), Signal::SIGKILL);
                if held.network_lock.as_deref() == Some(NetworkLock::Nftables.name())
                    && let Err(e) = self.shared.left_locks.record(&held.images)
                {
                    warn!(checkpoint = %held.id, error = %e, "cannot record the eviction's network lock; it stays");
                }
                return;
            }
            Err(StoreError::NotFound(_)) => {}
            Err(e) => warn!(
                checkpoint = %held.id,
                error = %crate::error_chain(&e),
                "cannot tell whether the interrupted checkpoint committed; giving the tree back (the checkpoint may exist too)"
            ),
        }
        info!(checkpoint = %held.id, ?pids, "giving back a tree a crash left held");
        let reuse_addr: HashSet<u64> = held.reuse_addr.iter().copied().collect();
        // Every process with CUDA loaded is asked for its state and put back from it.
        let tree = HeldProcesses {
            gpu_pids: self.deps.host.cuda_candidates(&pids),
            pids,
            stopped_before: &held.stopped_before,
            reuse_addr: &reuse_addr,
            images: &held.images,
            lock: held.network_lock.as_deref().and_then(NetworkLock::from_name),
            container_init: held.container_init,
        };
        let problems = self.give_tree_back(tree).await;
        for problem in problems {
            warn!(checkpoint = %held.id, problem = %problem, "giving back a held tree was incomplete");
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn record(id: &str) -> HeldTree {
        HeldTree {
            id: id.into(),
            processes: vec![(4_194_401, 1)],
            stopped_before: Vec::new(),
            images: "/nonexistent/images".into(),
            network_lock: None,
            reuse_addr: Vec::new(),
            container_init: None,
        }
    }

    #[test]
    fn a_save_cut_short_at_any_byte_leaves_the_previous_record_whole() {
        let dir = tempfile::tempdir().unwrap();
        let old = record("20261126-000000-aaaaaa");
        old.save(dir.path()).unwrap();
        let new = HeldTree { stopped_before: vec![4_194_402], ..old.clone() };
        let data = serde_json::to_vec(&new).unwrap();
        let staging = crate::linux::durable_file::staging_name(&HeldTree::path(dir.path(), &new.id));
        for cut in 0..=data.len() {
            std::fs::write(&staging, &data[..cut]).unwrap();
            let all = HeldTree::all(dir.path());
            assert_eq!(all.len(), 1, "cut at {cut}: {all:?}");
            assert_eq!(all[0].as_ref().ok(), Some(&old), "cut at {cut}");
        }
        new.save(dir.path()).unwrap();
        assert_eq!(HeldTree::all(dir.path()).into_iter().map(Result::unwrap).collect::<Vec<_>>(), [new]);
    }
}

#[cfg(test)]
mod settle_tests {
    use super::*;
    use crate::criu::fake::FakeCriu;
    use crate::cuda::ProcessState;
    use crate::cuda::fake::FakeGpu;
    use crate::engine::host::Containers;
    use crate::engine::rollback_tests::{ROOT, rig};

    /// A container's init, above Linux's largest pid_max like the rig's tree.
    const INIT: i32 = 4_194_400;

    #[tokio::test]
    async fn a_crash_inside_a_container_s_gpu_phase_is_settled_through_the_driver_in_the_container() {
        let r = rig(FakeCriu::default(), FakeGpu::default());
        r.host.add_container(INIT, ROOT);
        // A stasisd died with the container's tree checkpointed on its GPU, no manifest written.
        let inside = r.host.cuda_in(&r.engine.deps.reaper, INIT);
        inside.lock(ROOT, 1000).unwrap();
        inside.checkpoint(ROOT).unwrap();
        let held = HeldTree {
            id: "20261127-000000-cccccc".into(),
            processes: vec![(ROOT, r.host.start_time(ROOT).unwrap())],
            stopped_before: Vec::new(),
            images: "/nonexistent/images".into(),
            network_lock: None,
            reuse_addr: Vec::new(),
            container_init: Some(INIT),
        };
        held.save(&r.engine.deps.state.held_dir()).unwrap();

        r.engine.recover_held().await;

        let fake = r.host.containers.cuda.lock().unwrap()[&INIT].clone();
        assert_eq!(fake.states.lock().unwrap().get(&ROOT), Some(&ProcessState::Running));
        let calls = ["lock", "checkpoint", "restore", "unlock"].map(|c| format!("{c} {ROOT}"));
        assert_eq!(fake.calls(), calls, "put back inside the container");
        assert!(r.gpu.calls().is_empty(), "stasisd's own driver is not asked about a container's processes");
        assert_eq!(r.held_records(), 0);
    }
}
