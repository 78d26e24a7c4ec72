//! A cgroup (v2) per managed workload, so its whole tree can be found and killed even after
//! processes re-parent. On a hybrid v1/v2 host the v2 hierarchy at /sys/fs/cgroup/unified is
//! used; without any v2 hierarchy workloads run without their own cgroup.

use std::fs::{self, File, OpenOptions};
use std::io;
use std::path::{Path, PathBuf};

use super::proc::ProcStat;

const PURE_V2: &str = "/sys/fs/cgroup";
const HYBRID_V2: &str = "/sys/fs/cgroup/unified";

/// The v2 hierarchy mounted on this host, if any.
pub fn v2_root() -> Option<PathBuf> {
    if Path::new(PURE_V2).join("cgroup.controllers").exists() {
        return Some(PURE_V2.into());
    }
    Path::new(HYBRID_V2).join("cgroup.procs").exists().then(|| HYBRID_V2.into())
}

/// The path of the cgroup at `dir` within the v2 hierarchy (`/stasis/...`), as CRIU names
/// cgroups.
pub fn hierarchy_path(dir: &Path) -> Option<String> {
    let within = dir.strip_prefix(v2_root()?).ok()?;
    Some(format!("/{}", within.display()))
}

/// The cgroup of one workload: `<v2 root>/stasis/<daemon>/<name>`, where `<daemon>` tells
/// apart the daemons of one machine (each has its own workloads, of possibly the same names).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct WorkloadCgroup {
    pub path: PathBuf,
}

impl WorkloadCgroup {
    /// Creates (or reuses) the cgroup of `workload` of daemon `daemon`.
    pub fn create(root: &Path, daemon: &str, workload: &str) -> io::Result<Self> {
        let path = root.join("stasis").join(daemon).join(workload);
        fs::create_dir_all(&path)?;
        Ok(Self { path })
    }

    /// Opens `cgroup.procs` for a child to write itself into before exec.
    pub fn open_procs(&self) -> io::Result<File> {
        OpenOptions::new().write(true).open(self.path.join("cgroup.procs"))
    }

    /// The pids currently in the cgroup.
    pub fn pids(&self) -> io::Result<Vec<i32>> {
        let text = fs::read_to_string(self.path.join("cgroup.procs"))?;
        Ok(text.lines().filter_map(|l| l.trim().parse().ok()).collect())
    }

    /// The root of the tree in the cgroup: a process of it whose parent is outside it.
    pub fn root_process(&self) -> Option<i32> {
        let pids = self.pids().ok()?;
        pids.iter().copied().find(|&pid| ProcStat::read(pid).is_ok_and(|s| !pids.contains(&s.ppid)))
    }

    /// Removes the cgroup if it is empty; a busy or missing cgroup is left alone.
    pub fn remove_if_empty(&self) {
        let _ = fs::remove_dir(&self.path);
    }
}
