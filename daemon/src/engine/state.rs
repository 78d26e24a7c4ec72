//! The daemon's state directory.
//!
//! ```text
//! <state>/workloads.json      registry of workloads (see workloads.rs)
//! <state>/logs/<name>.log     stdout and stderr of managed workloads
//! <state>/work/<job>/         CRIU image directories of running jobs, removed afterwards
//! <state>/inflight/<id>       checkpoints being uploaded; any found at start are orphans
//! ```

use std::fs;
use std::io;
use std::path::{Path, PathBuf};

#[derive(Debug, Clone)]
pub struct StateDir {
    root: PathBuf,
}

impl StateDir {
    /// Creates the layout under `root` (mode 0700: images hold process memory).
    pub fn open(root: &Path) -> io::Result<Self> {
        use std::os::unix::fs::DirBuilderExt;
        for sub in ["", "logs", "work", "inflight"] {
            fs::DirBuilder::new().recursive(true).mode(0o700).create(root.join(sub))?;
        }
        Ok(Self { root: root.to_path_buf() })
    }

    pub fn root(&self) -> &Path {
        &self.root
    }

    pub fn registry_file(&self) -> PathBuf {
        self.root.join("workloads.json")
    }

    pub fn log_file(&self, workload: &str) -> PathBuf {
        self.root.join("logs").join(format!("{workload}.log"))
    }

    /// A fresh, empty work directory for job `job`.
    pub fn new_work_dir(&self, job: &str) -> io::Result<WorkDir> {
        let path = self.root.join("work").join(job);
        let _ = fs::remove_dir_all(&path);
        fs::create_dir_all(&path)?;
        Ok(WorkDir { path })
    }

    /// Records that checkpoint `id` is being uploaded.
    pub fn mark_inflight(&self, id: &str) -> io::Result<()> {
        fs::write(self.root.join("inflight").join(id), b"")
    }

    pub fn clear_inflight(&self, id: &str) {
        let _ = fs::remove_file(self.root.join("inflight").join(id));
    }

    /// Checkpoints whose upload was interrupted (by a crash) before it committed.
    pub fn inflight(&self) -> io::Result<Vec<String>> {
        let mut ids = Vec::new();
        for entry in fs::read_dir(self.root.join("inflight"))? {
            ids.push(entry?.file_name().to_string_lossy().into_owned());
        }
        Ok(ids)
    }

    /// Removes work directories left by a previous run.
    pub fn clear_work(&self) -> io::Result<()> {
        for entry in fs::read_dir(self.root.join("work"))? {
            fs::remove_dir_all(entry?.path())?;
        }
        Ok(())
    }
}

/// A job's scratch directory, removed when dropped.
#[derive(Debug)]
pub struct WorkDir {
    path: PathBuf,
}

impl WorkDir {
    pub fn path(&self) -> &Path {
        &self.path
    }
}

impl Drop for WorkDir {
    fn drop(&mut self) {
        let _ = fs::remove_dir_all(&self.path);
    }
}
