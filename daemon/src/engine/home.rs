//! Where a workload lives on this node: the log file its output goes to, its cgroup, and for
//! a tree with a pid namespace of its own the working directory of the namespace's init.
//! `stasis run` gives a new workload a home; a restore gives the restored tree this node's
//! home of the workload it becomes, whichever node (and workload name) the checkpoint came
//! from, so a copy (`stasis restore --as`) or a tree restored on another node writes to a log
//! and sits in a cgroup of its own.

use std::fs::{self, File, OpenOptions};
use std::io;
use std::os::unix::fs::{DirBuilderExt, OpenOptionsExt};
use std::path::{Path, PathBuf};
use std::sync::Arc;

use super::host::Host;
use super::{Caller, Engine};

/// A workload's log and cgroup, made ready for a tree to move in.
///
/// A cgroup still empty when the home is dropped (the start or restore failed, or the tree
/// is gone already) is removed: one holding the tree stays.
pub(super) struct Home {
    pub log_path: PathBuf,
    /// The log, opened for appending.
    pub log: File,
    /// The cgroup's path.
    pub cgroup: Option<PathBuf>,
    /// Where the cgroup is.
    host: Arc<dyn Host>,
}

/// Where the inits of workloads with a pid namespace of their own work, one directory each
/// (see `stasis-init`): the same path on every node, so that a checkpoint's init finds its
/// directory wherever it is restored.
const INIT_DIRS: &str = "/run/stasis/init";

/// A new, empty working directory for a namespace init.
pub(super) fn new_init_dir() -> io::Result<PathBuf> {
    let dir = Path::new(INIT_DIRS).join(format!("{:016x}", rand::random::<u64>()));
    create_init_dir(&dir)?;
    Ok(dir)
}

/// The working directory `recorded` in a checkpoint for its namespace init, made again if it
/// is gone; refused unless it is one of [`INIT_DIRS`].
pub(super) fn init_dir_again(recorded: &str) -> io::Result<()> {
    let dir = Path::new(recorded);
    let name = dir.file_name().and_then(|n| n.to_str()).unwrap_or_default();
    if dir.parent() != Some(Path::new(INIT_DIRS))
        || name.is_empty()
        || !name.chars().all(|c| c.is_ascii_hexdigit())
    {
        return Err(io::Error::new(
            io::ErrorKind::InvalidData,
            format!(
                "the checkpoint names {recorded:?} as its init's directory, which is not one of {INIT_DIRS}"
            ),
        ));
    }
    match create_init_dir(dir) {
        Err(e) if e.kind() != io::ErrorKind::AlreadyExists => Err(e),
        _ => Ok(()),
    }
}

/// Makes init directory `dir` (root's alone), failing if it exists.
fn create_init_dir(dir: &Path) -> io::Result<()> {
    fs::create_dir_all(INIT_DIRS)?;
    fs::DirBuilder::new().mode(0o700).create(dir)
}

impl Home {
    /// The cgroup's path within the v2 hierarchy, as CRIU names it.
    pub fn cgroup_in_hierarchy(&self) -> Option<String> {
        self.host.cgroup_in_hierarchy(self.cgroup.as_ref()?)
    }

    /// A new terminal whose output goes to the log: what a restored tree gets for one it had.
    pub fn terminal(&self) -> io::Result<std::os::fd::OwnedFd> {
        self.host.terminal_to_log(&self.log_path)
    }
}

impl Drop for Home {
    fn drop(&mut self) {
        if let Some(cgroup) = &self.cgroup {
            self.host.remove_empty_cgroup(cgroup);
        }
    }
}

impl Engine {
    /// The home of workload `name`, its log owned by `caller`; with `with_cgroup`, a cgroup
    /// too, where the host has a v2 hierarchy. On failure, what could not be made (and nothing
    /// made stays).
    pub(super) fn home(
        &self,
        name: &str,
        caller: Caller,
        with_cgroup: bool,
    ) -> Result<Home, (&'static str, io::Error)> {
        let log_path = self.deps.state.log_file(name);
        let log = open_log(&log_path, caller).map_err(|e| ("its log file", e))?;
        let host = self.deps.host.clone();
        let cgroup = match with_cgroup {
            true => host.create_cgroup(self.deps.store.node_tag(), name).map_err(|e| ("its cgroup", e))?,
            false => None,
        };
        Ok(Home { log_path, log, cgroup, host })
    }
}

/// Opens (appending) a workload's log file, owned by whom the workload runs as.
fn open_log(path: &Path, caller: Caller) -> io::Result<File> {
    let log = OpenOptions::new().create(true).append(true).mode(0o600).open(path)?;
    if let Caller::User { uid, gid } = caller {
        std::os::unix::fs::fchown(&log, Some(uid), Some(gid))?;
    }
    Ok(log)
}
