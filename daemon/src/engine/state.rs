//! The daemon's state directory.
//!
//! ```text
//! <state>/workloads.json      registry of workloads (see workloads.rs)
//! <state>/logs/<name>.log     stdout and stderr of managed workloads
//! <state>/work/<job>/         CRIU image directories of running jobs, removed afterwards
//! <state>/inflight/<id>       checkpoints being uploaded; any found at start are orphans
//! <state>/netlocks/<run id>   network locks evictions left (see sockets/left_locks.rs)
//! <state>/held/<id>.json      trees a checkpoint holds (stopped, GPU-suspended); a crashed
//!                             stasisd's next start gives them back (checkpoint/crash_record.rs)
//! /dev/shm/stasis-restore-<daemon>-<random>/   restore scratch, when memory has room
//! ```

use std::fs;
use std::io;
use std::path::{Path, PathBuf};

/// Shared memory: a tmpfs on Linux systems.
const SHM: &str = "/dev/shm";
/// Names of restores' work directories under work/ start with this.
const RESTORE_DIR: &str = "restore-";

#[derive(Debug, Clone)]
pub struct StateDir {
    root: PathBuf,
}

impl StateDir {
    /// Creates the layout under `root` (mode 0700: images hold process memory).
    pub fn open(root: &Path) -> io::Result<Self> {
        use std::os::unix::fs::DirBuilderExt;
        crate::linux::private_dir::ensure_private_dir(root)?;
        for sub in ["logs", "work", "inflight", "netlocks", "held"] {
            fs::DirBuilder::new().recursive(true).mode(0o700).create(root.join(sub))?;
        }
        Ok(Self { root: root.to_path_buf() })
    }

    pub fn root(&self) -> &Path {
        &self.root
    }

    pub fn held_dir(&self) -> PathBuf {
        self.root.join("held")
    }

    pub fn netlocks_dir(&self) -> PathBuf {
        self.root.join("netlocks")
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

    /// A scratch directory for rebuilding `bytes` of images for a restore: in memory
    /// (/dev/shm) when it has room for twice that, as CRIU then reads them at memory speed;
    /// else a work directory in the state directory.
    pub fn new_restore_dir(&self, bytes: u64) -> io::Result<WorkDir> {
        use std::os::unix::fs::DirBuilderExt;
        let shm = Path::new(SHM);
        let room =
            nix::sys::statvfs::statvfs(shm).map(|s| s.blocks_available() * s.fragment_size()).unwrap_or(0);
        if room < bytes.saturating_mul(2) {
            return self.new_work_dir(&format!("{RESTORE_DIR}{:08x}", rand::random::<u32>()));
        }
        let path = shm.join(format!("{}{:016x}", self.shm_prefix(), rand::random::<u64>()));
        // A fresh private directory: creation fails rather than reuse anything in the way.
        fs::DirBuilder::new().mode(0o700).create(&path)?;
        Ok(WorkDir { path })
    }

    /// Names of this daemon's scratch directories in /dev/shm start with this.
    fn shm_prefix(&self) -> String {
        let tag = blake3::hash(self.root.as_os_str().as_encoded_bytes());
        format!("stasis-restore-{}-", hex::encode(&tag.as_bytes()[..4]))
    }

    /// Work directories a previous run left: everything under work/, and its restores'
    /// scratch directories in /dev/shm.
    fn left_work(&self) -> io::Result<Vec<PathBuf>> {
        let mut left: Vec<PathBuf> = Vec::new();
        for entry in fs::read_dir(self.root.join("work"))? {
            left.push(entry?.path());
        }
        // Only directories of root's: anyone may make one of that name in /dev/shm.
        let prefix = self.shm_prefix();
        let ours = |e: &fs::DirEntry| {
            use std::os::unix::fs::MetadataExt;
            e.metadata().is_ok_and(|m| m.is_dir() && m.uid() == 0)
        };
        for entry in fs::read_dir(SHM).into_iter().flatten().flatten() {
            if entry.file_name().to_string_lossy().starts_with(&prefix) && ours(&entry) {
                left.push(entry.path());
            }
        }
        Ok(left)
    }

    /// Whether `path` is (or lies in) one of this daemon's restore directories, whether or not
    /// it still exists: where a restore's CRIU works.
    pub fn is_restore_dir(&self, path: &Path) -> bool {
        let (prefix, work) = (self.shm_prefix(), self.root.join("work"));
        path.ancestors().any(|dir| {
            let (Some(parent), Some(name)) = (dir.parent(), dir.file_name()) else { return false };
            let name = name.to_string_lossy();
            (parent == Path::new(SHM) && name.starts_with(&prefix))
                || (parent == work && name.starts_with(RESTORE_DIR))
        })
    }

    /// Removes work directories left by a previous run: each it can, the first failure
    /// returned once all were tried.
    pub fn clear_work(&self) -> io::Result<()> {
        let mut failed = Ok(());
        for dir in self.left_work()? {
            if let Err(e) = remove_work_dir(&dir) {
                failed = failed.and(Err(io::Error::new(e.kind(), format!("{}: {e}", dir.display()))));
            }
        }
        failed
    }
}

/// Removes `dir`, a work directory, with what a killed CRIU left mounted in it (its cgroup
/// yard) detached first: removing the directory must not walk into those mounts.
fn remove_work_dir(dir: &Path) -> io::Result<()> {
    crate::linux::mounts::detach_beneath(dir)?;
    fs::remove_dir_all(dir)
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
    /// Removes the directory before returning (a caller may count on it being gone). Images
    /// of a large tree take a while to remove: on a worker of tokio's multi-threaded runtime
    /// the removal blocks in place, its other tasks handed to another worker meanwhile.
    fn drop(&mut self) {
        let remove = || {
            let _ = remove_work_dir(&self.path);
        };
        match tokio::runtime::Handle::try_current().map(|h| h.runtime_flavor()) {
            Ok(tokio::runtime::RuntimeFlavor::MultiThread) => tokio::task::block_in_place(remove),
            _ => remove(),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn a_work_directory_is_gone_once_dropped_on_any_thread_of_the_runtime() {
        let dir = tempfile::tempdir().unwrap();
        let state = StateDir::open(dir.path()).unwrap();
        let (on_worker, on_blocking) = (state.new_work_dir("a").unwrap(), state.new_work_dir("b").unwrap());
        let paths = [on_worker.path().to_path_buf(), on_blocking.path().to_path_buf()];
        std::fs::write(paths[0].join("pages.img"), b"x").unwrap();
        tokio::spawn(async move { drop(on_worker) }).await.unwrap();
        tokio::task::spawn_blocking(move || drop(on_blocking)).await.unwrap();
        assert!(paths.iter().all(|p| !p.exists()), "{paths:?}");
    }

    #[test]
    fn restore_scratch_goes_to_memory_when_it_fits_and_is_cleaned() {
        let dir = tempfile::tempdir().unwrap();
        let state = StateDir::open(dir.path()).unwrap();
        let small = state.new_restore_dir(1 << 20).unwrap();
        assert!(small.path().starts_with(SHM), "{:?}", small.path());
        let huge = state.new_restore_dir(u64::MAX / 4).unwrap();
        assert!(huge.path().starts_with(dir.path()), "{:?}", huge.path());
        let checkpoint = state.new_work_dir("20261128-180620-ba139e").unwrap();
        let left: Vec<PathBuf> = [&small, &huge, &checkpoint].map(|w| w.path().to_path_buf()).to_vec();
        [small, huge, checkpoint].into_iter().for_each(std::mem::forget);
        let restores: Vec<bool> = left.iter().map(|d| state.is_restore_dir(&d.join("pages-1.img"))).collect();
        assert_eq!(
            restores,
            [true, true, false],
            "the restores' directories, not the checkpoint's: {left:?}"
        );
        state.clear_work().unwrap();
        assert!(left.iter().all(|p| !p.exists()), "leftover work directories are removed at start");
        assert!(left[..2].iter().all(|d| state.is_restore_dir(d)), "told by name once removed too");
        let other = StateDir::open(&dir.path().join("other")).unwrap();
        assert!(!other.is_restore_dir(&left[0]), "another daemon's restore");
    }

    #[test]
    fn a_directory_someone_else_made_under_the_scratch_name_is_not_touched() {
        if !nix::unistd::geteuid().is_root() {
            return;
        }
        let dir = tempfile::tempdir().unwrap();
        let state = StateDir::open(dir.path()).unwrap();
        let theirs = Path::new(SHM).join(format!("{}their-own", state.shm_prefix()));
        fs::create_dir(&theirs).unwrap();
        fs::write(theirs.join("data"), b"x").unwrap();
        std::os::unix::fs::chown(&theirs, Some(65534), Some(65534)).unwrap();
        state.clear_work().unwrap();
        let kept = theirs.join("data").exists();
        fs::remove_dir_all(&theirs).unwrap();
        assert!(kept, "stasisd removed a directory it did not make");
    }
}
