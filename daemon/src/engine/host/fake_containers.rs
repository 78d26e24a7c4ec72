//! The fake's containers: inits a test makes, each pid 1 of a pid namespace of its own, with
//! their children; and the pids reserved in them.

use std::collections::HashMap;
use std::fs::File;
use std::io;
use std::os::fd::OwnedFd;
use std::path::PathBuf;
use std::sync::{Arc, Mutex};

use async_trait::async_trait;

use super::Containers;
use super::fake::FakeHost;
use crate::cuda::GpuCheckpointer;
use crate::cuda::fake::FakeGpu;
use crate::linux::reaper::Reaper;

#[derive(Debug, Default)]
pub struct FakeContainers {
    /// The containers' inits, each with the processes that are its children while they run.
    pub inits: Mutex<HashMap<i32, Vec<i32>>>,
    /// The pids reserved, in order: in the namespace of which init, above which pid, and the
    /// pids needed free there.
    pub reserved: Mutex<Vec<(i32, i32, Vec<i32>)>>,
    /// The CUDA driver inside each container (by init), made on first use; each records the
    /// calls made on it.
    pub cuda: Mutex<HashMap<i32, Arc<FakeGpu>>>,
}

impl FakeHost {
    /// Starts a container whose init is `init`, with the process `child` (running or not) as
    /// its child.
    pub fn add_container(&self, init: i32, child: i32) {
        self.running.lock().unwrap().insert(init);
        self.containers.inits.lock().unwrap().insert(init, vec![child]);
    }
}

#[async_trait]
impl Containers for FakeHost {
    fn is_namespace_init(&self, pid: i32) -> bool {
        self.containers.inits.lock().unwrap().contains_key(&pid)
    }

    /// An init and its children are in the init's namespace (numbered by the init's pid),
    /// every other process in stasisd's (0).
    fn pid_namespace(&self, pid: i32) -> io::Result<u64> {
        let inits = self.containers.inits.lock().unwrap();
        let mut containers = inits.iter();
        Ok(containers
            .find(|(init, children)| **init == pid || children.contains(&pid))
            .map_or(0, |c| *c.0 as u64))
    }

    fn children(&self, pid: i32) -> Vec<i32> {
        let running = self.running.lock().unwrap();
        let inits = self.containers.inits.lock().unwrap();
        inits.get(&pid).into_iter().flatten().copied().filter(|p| running.contains(p)).collect()
    }

    fn threads(&self, pid: i32) -> Vec<i32> {
        vec![pid]
    }

    /// Each process's descriptors are one pipe (as a container's stdio is, to its runtime).
    fn fd_target(&self, pid: i32, _fd: i32) -> io::Result<String> {
        Ok(format!("pipe:[{pid}]"))
    }

    fn copy_fd_of(&self, _pid: i32, _fd: i32) -> io::Result<OwnedFd> {
        self.check("copy_fd_of")?;
        Ok(File::open("/dev/null")?.into())
    }

    fn ensure_tmp(&self, _pid: i32) -> io::Result<()> {
        self.check("ensure_tmp")
    }

    /// The fake's containers are in no cgroup of their own.
    fn cgroup_procs_files(&self, _pid: i32) -> io::Result<Vec<PathBuf>> {
        self.check("cgroup_procs_files")?;
        Ok(Vec::new())
    }

    async fn reserve_pids(
        &self,
        _reaper: &Reaper,
        init: i32,
        highest: i32,
        needed: &[i32],
    ) -> io::Result<()> {
        self.check("reserve_pids")?;
        self.containers.reserved.lock().unwrap().push((init, highest, needed.to_vec()));
        Ok(())
    }

    fn cuda_in(&self, _reaper: &Reaper, init: i32) -> Arc<dyn GpuCheckpointer> {
        self.containers.cuda.lock().unwrap().entry(init).or_default().clone()
    }
}
