//! The checkpoint's images fetched, and CRIU's restore of the tree from them, with the files
//! it gets in place of those it held outside itself and its memory served by stasisd.

use std::os::fd::OwnedFd;
use std::path::Path;
use std::sync::Arc;

use crate::criu::RestoreSpec;
use crate::engine::checkpoint::tree_options;
use crate::engine::home::Home;
use crate::engine::hot_restore::{FaultGuard, LazyError, LazySession};
use crate::engine::pods::{self, ContainerRef};
use crate::engine::{Engine, ProgressFn, ProgressUpdate, RestoreError};
use crate::store::{LazyMemory, Manifest, MemoryMode};

impl Engine {
    /// Writes the checkpoint's images into `dir`, leaving the memory stasisd puts in place
    /// itself in the store, and returns it: for a lazy restore, all CRIU can restore lazily
    /// but the host copies of device memory (the CUDA restore reads them at once); for an
    /// eager one all it can, unless eager restores use image files (`--eager-restore files`,
    /// or a kernel without the userfaultfd it needs).
    pub(super) async fn fetch_images(
        &self,
        manifest: &Manifest,
        dir: &Path,
        lazy: bool,
        progress: &ProgressFn,
    ) -> Result<(u64, LazyMemory), RestoreError> {
        let report: crate::store::Progress = {
            let progress = progress.clone();
            Arc::new(move |done, total| progress(ProgressUpdate { phase: "download", done, total }))
        };
        let mode = match (lazy, self.settings.eager_served) {
            (true, _) => MemoryMode::Lazy { eager: &manifest.gpu_host_memory },
            (false, true) => MemoryMode::Lazy { eager: &[] },
            (false, false) => MemoryMode::Eager,
        };
        Ok(self.deps.store.materialize_as(manifest, dir, mode, report).await?)
    }

    /// Lets CRIU restore the tree from `dir` (its memory put in place through `session`);
    /// returns the restored root's pid. A failure leaves nothing running: CRIU removes a tree
    /// it could not restore, and one whose fault guard did not start, or whose memory could
    /// not be put in place before it ran, is killed.
    pub(super) async fn run_criu(
        &self,
        manifest: &Manifest,
        placement: &Placement,
        dir: &Path,
        tcp_close: bool,
        session: Option<LazySession>,
        progress: &ProgressFn,
    ) -> Result<(i32, Option<LazySession>), RestoreError> {
        let id = manifest.id.clone();
        let tree = tree_options(&manifest.options.clone().unwrap_or_default());
        let placed = match placement {
            Placement::Home(home) => replacement_files(manifest, home, &tree.external).map(|files| {
                (files, home.cgroup_in_hierarchy().filter(|_| !manifest.cgroup.is_empty()), None)
            }),
            Placement::Container(c) => {
                pods::prepare_restore(self.deps.host.as_ref(), manifest, c, &self.deps.reaper)
                    .await
                    .map(|(files, enter)| (files, None, Some(enter)))
                    .map_err(RestoreError::local("entering the container"))
            }
        };
        let (inherit_fds, cgroup, enter) = match placed {
            Ok(placed) => placed,
            Err(e) => {
                // Nothing was restored: the lazy-pages daemon started for it goes too.
                session.into_iter().for_each(LazySession::abort);
                return Err(e);
            }
        };
        progress(ProgressUpdate { phase: "restore", done: 0, total: 0 });
        let spec = RestoreSpec {
            images_dir: dir.to_path_buf(),
            tree,
            inherit_fds,
            lazy_pages: session.is_some(),
            tcp_close,
            cgroup,
            enter,
            running: session.as_ref().map(LazySession::running_criu),
        };
        session.iter().for_each(LazySession::arm);
        let faults = session.as_ref().map(LazySession::fault_guard);
        if let Some(guard) = &faults {
            guard.hand_over(spec.inherit_fds.iter().filter_map(|(_, fd)| file_id(fd)).collect());
        }
        let lazy = session.as_ref().is_some_and(LazySession::is_lazy);
        let pre_resume = session.as_ref().map(LazySession::pre_resume);
        let mut on_notify =
            move |script: &str, criu: i32| match pre_resume.as_ref().filter(|_| script == "pre-resume") {
                Some(pre_resume) => pre_resume(criu),
                None => Ok(()),
            };
        let criu = self.deps.criu.clone();
        let restored = tokio::task::spawn_blocking(move || criu.restore(&spec, &mut on_notify))
            .await
            .map_err(RestoreError::panicked("restore thread"))
            .and_then(|r| r.map_err(|source| RestoreError::Criu { id: id.clone(), source }));
        let unguarded = faults.as_ref().and_then(FaultGuard::not_started);
        match (restored, unguarded) {
            (Ok(pid), None) => Ok((pid, session)),
            (Ok(pid), Some(reason)) => {
                // CRIU only logs a failed notification and lets the tree run: kill it, since
                // nothing guards its faults.
                if let Some(session) = session {
                    session.kill_tree();
                    session.abort();
                }
                Err(RestoreError::Lazy { id, lazy, pid, source: LazyError::Guard(reason) })
            }
            (Err(e), _) => {
                let Some(mut session) = session else { return Err(e) };
                // The reason the tree was killed at pre-resume, if it was.
                let guard_failed = faults.as_ref().and_then(FaultGuard::failed).map(LazyError::Guard);
                let served = session.serve_failure().await.or(guard_failed);
                session.abort();
                match (served, e) {
                    (Some(source), RestoreError::Criu { source: criu, .. }) => {
                        Err(RestoreError::LazyDuringRestore { id, lazy, source, criu: Box::new(criu) })
                    }
                    (_, e) => Err(e),
                }
            }
        }
    }
}

/// Where a restored tree goes.
pub(super) enum Placement {
    /// This node's home of the workload it becomes (its log, cgroup, init's directory).
    Home(Home),
    /// A Kubernetes container, as its init's child (see `pods/`).
    Container(ContainerRef),
}

/// What the restored tree gets in place of what it held outside itself: the workload's log
/// on this node for the log file it wrote to, and a new terminal, logged there too, for each
/// terminal it had.
fn replacement_files(
    manifest: &Manifest,
    home: &Home,
    external: &[String],
) -> Result<Vec<(String, OwnedFd)>, RestoreError> {
    let mut files: Vec<(String, OwnedFd)> = external
        .iter()
        .filter(|k| crate::linux::pty::is_tty_key(k))
        .map(|key| Ok((key.clone(), home.terminal()?)))
        .collect::<std::io::Result<_>>()
        .map_err(RestoreError::local("terminal"))?;
    if let Some(path) = manifest.log_file.strip_prefix('/') {
        // CRIU names a regular file by its path without the leading slash.
        let log = home.log.try_clone().map_err(RestoreError::local("its log file"))?;
        files.push((path.to_owned(), log.into()));
    }
    Ok(files)
}

/// The device and inode of the file open as `fd`.
fn file_id(fd: &std::os::fd::OwnedFd) -> Option<(u64, u64)> {
    nix::sys::stat::fstat(fd).ok().map(|st| (st.st_dev, st.st_ino))
}
