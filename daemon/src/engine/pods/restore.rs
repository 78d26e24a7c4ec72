//! Restoring a container's tree into a new container of the same identity and image, as the
//! child of that container's init (which waits for it).
//!
//! ```text
//! newest checkpoint of the identity (none, or another image: start fresh)
//!   -> preflight (sockets, CPU, no GPU state yet) -> download images
//!   -> next pids of the container above the tree's -> CRIU inside the container's
//!      namespaces and cgroups, the init's stdout and stderr for the old ones
//!   -> the tree's root, reparented to the init once CRIU exits
//! ```

use std::os::fd::OwnedFd;
use std::time::{Duration, Instant};

use tracing::{info, warn};

use super::super::checkpoint::tree_options;
use super::super::{Engine, ProgressFn, RestoreError, RestoreTarget};
use super::{ContainerRef, enter};
use crate::criu::RestoreSpec;
use crate::linux::{container, proc, sys};
use crate::store::{Manifest, MemoryMode};

/// What a starting container does.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum PodStart {
    /// Run its command: nothing to restore (`why`).
    Fresh { why: String },
    /// Wait for its tree, restored from `checkpoint`: its root is `pid` inside the container.
    Restored { checkpoint: String, pid: i32 },
}

/// How long the restored root takes to become the container init's child once CRIU is done.
const REPARENT_WAIT: Duration = Duration::from_secs(5);

impl Engine {
    /// What the container of workload `name` should do as it starts: restore the newest
    /// checkpoint of its identity, made in a container of the same image, into it; or run
    /// afresh.
    pub(super) async fn start_container(
        &self,
        name: &str,
        c: &ContainerRef,
        progress: &ProgressFn,
    ) -> Result<PodStart, RestoreError> {
        let manifest = match self.find_manifest(&RestoreTarget::Workload(name.to_owned())).await {
            Ok(m) => m,
            Err(RestoreError::NoCheckpoints(_)) => {
                return Ok(PodStart::Fresh { why: "no checkpoint".into() });
            }
            Err(e) => return Err(e),
        };
        let image = manifest.pod.as_ref().map(|p| p.image.as_str()).unwrap_or_default();
        if image != c.image {
            let why = format!(
                "checkpoint {} is of image {image:?}, this container runs {:?}",
                manifest.id, c.image
            );
            info!(workload = %name, why = %why, "starting afresh");
            return Ok(PodStart::Fresh { why });
        }
        let _guard = self.lock_workload(name).await;
        let started = Instant::now();
        let pid = self.restore_into(&manifest, c, progress).await?;
        if let Err(e) = self.registry.update(name, |w| {
            w.pid = pid;
            w.last_checkpoint = Some(manifest.id.clone());
            w.last_error = None;
        }) {
            warn!(workload = %name, error = %e, "cannot record the restore in the workload registry");
        }
        let inner = proc::pid_inside(pid, c.init_pid).unwrap_or_default();
        info!(checkpoint = %manifest.id, workload = %name, pid, inner, ms = started.elapsed().as_millis() as u64, "restored into its container");
        Ok(PodStart::Restored { checkpoint: manifest.id.clone(), pid: inner })
    }

    /// Restores `manifest` into container `c`; returns the restored root's (host) pid.
    async fn restore_into(
        &self,
        manifest: &Manifest,
        c: &ContainerRef,
        progress: &ProgressFn,
    ) -> Result<i32, RestoreError> {
        let id = manifest.id.clone();
        let local = |what| RestoreError::local(what);
        if !manifest.gpu_pids.is_empty() {
            let reason = "restoring GPU state into a container is not supported yet".to_owned();
            return Err(RestoreError::Incompatible { id, reason });
        }
        let pod = manifest.pod.clone().unwrap_or_default();
        let tcp_close = true;
        self.preflight(manifest, &[], tcp_close).await?;
        let bytes = manifest.stats.map(|s| s.bytes_total).unwrap_or_default();
        let work = self.state.new_restore_dir(bytes).map_err(local("restore scratch directory"))?;
        let _commit_guard = self.store.begin_commit().await?;
        let report: crate::store::Progress = {
            let progress = progress.clone();
            std::sync::Arc::new(move |done, total| {
                progress(super::super::ProgressUpdate { phase: "download", done, total })
            })
        };
        self.store.materialize_as(manifest, work.path(), MemoryMode::Eager, report).await?;
        let highest = pod.inner_pids.iter().copied().max().unwrap_or(1);
        container::reserve_pids(c.init_pid, highest).map_err(local("the container's next pid"))?;
        let spec = RestoreSpec {
            images_dir: work.path().to_path_buf(),
            tree: tree_options(&manifest.options.clone().unwrap_or_default()),
            inherit_fds: stdio_of(c.init_pid, &pod.stdio).map_err(local("the container's stdio"))?,
            lazy_pages: false,
            tcp_close,
            cgroup: None,
            enter: Some(enter(c, true).map_err(local("entering the container"))?),
        };
        let criu = self.criu.clone();
        let restored = tokio::task::spawn_blocking(move || criu.restore(&spec, &mut |_, _| Ok(())))
            .await
            .map_err(|e| local("restore thread")(std::io::Error::other(e)))?
            .map_err(|source| RestoreError::Criu { id: id.clone(), source })?;
        // CRIU answers with the root's pid inside the container; once CRIU is gone the root
        // is the init's child.
        let deadline = Instant::now() + REPARENT_WAIT;
        loop {
            let children = proc::children(c.init_pid).unwrap_or_default();
            if let Some(&pid) = children.iter().find(|&&p| proc::pid_inside(p, c.init_pid) == Some(restored))
            {
                return Ok(pid);
            }
            if Instant::now() > deadline {
                let why =
                    format!("restored process {restored} did not become the child of the container's init");
                return Err(local("finding the restored tree")(std::io::Error::other(why)));
            }
            tokio::time::sleep(Duration::from_millis(20)).await;
        }
    }
}

/// The new container's stdout and stderr (its init's) for the pipes the tree's root wrote to
/// in the old one, keyed as CRIU names them (`pipe:[ino]`).
fn stdio_of(init: i32, recorded: &[String]) -> std::io::Result<Vec<(String, OwnedFd)>> {
    let mut fds: Vec<(String, OwnedFd)> = Vec::new();
    for (fd, key) in recorded.iter().enumerate().skip(1) {
        if key.starts_with("pipe:") && !fds.iter().any(|(k, _)| k == key) {
            fds.push((key.clone(), sys::copy_fd_of(init, fd as i32)?));
        }
    }
    Ok(fds)
}
