//! Restoring a container's tree into a new container of the same identity and image, as the
//! child of that container's init (which waits for it). The restore job itself is the one of
//! every checkpoint (`engine/restore.rs`, lazy by default here); what is particular to a
//! container is here: which checkpoint, how CRIU enters the container, and finding the root
//! once it is the init's.
//!
//! ```text
//! newest checkpoint of the identity (none, or another image: start fresh)
//!   -> restore job: next pids of the container above the tree's, CRIU inside the container's
//!      namespaces and cgroups, the init's stdout and stderr for the old ones
//!   -> the tree runs (its memory still arriving): the init is told its root
//! ```

use std::os::fd::OwnedFd;
use std::sync::Arc;
use std::time::{Duration, Instant};

use tokio::sync::oneshot;
use tracing::info;

use super::super::host::{Containers, Host};
use super::super::{Caller, Engine, ProgressFn, RestoreError, RestoreParams, RestoreTarget};
use super::{ContainerRef, enter};
use crate::criu::Enter;
use crate::linux::reaper::Reaper;
use crate::store::Manifest;

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
    /// What the container of workload `name` should do as it starts: restore into it the
    /// newest checkpoint of its identity made in a container of the same image (answering
    /// once the tree runs, before all its memory is in), or run afresh.
    pub(super) async fn start_container(
        self: &Arc<Self>,
        name: &str,
        c: &ContainerRef,
        progress: ProgressFn,
    ) -> Result<PodStart, RestoreError> {
        let manifest = match self.find_manifest(&RestoreTarget::Workload(name.to_owned())).await {
            Ok(m) => m,
            Err(RestoreError::NoCheckpoints(_)) => {
                return Ok(PodStart::Fresh { why: "no checkpoint".into() });
            }
            Err(e) => return Err(e),
        };
        // Only a container's own checkpoint goes into a container: not one a user made of a
        // tree of their own under a container's name (before such names were root's).
        if manifest.pod.is_none() {
            let why = format!("checkpoint {} was not made of a container", manifest.id);
            return Ok(PodStart::Fresh { why });
        }
        let image = manifest.pod.as_ref().map(|p| p.image.as_str()).unwrap_or_default();
        if image != c.image && !c.any_image {
            let why = format!(
                "checkpoint {} is of image {image:?}, this container runs {:?}",
                manifest.id, c.image
            );
            info!(workload = %name, why = %why, "starting afresh");
            return Ok(PodStart::Fresh { why });
        }
        let (running, runs) = oneshot::channel();
        let params = RestoreParams {
            target: RestoreTarget::Checkpoint(manifest.id.clone()),
            gpu_map: Vec::new(),
            lazy: true,
            // The pod's address may differ: its connections are reset, not resumed.
            tcp_close: true,
            on_running: Some(Box::new(move |outcome| {
                let _ = running.send(outcome);
            })),
            caller: Caller::Root,
            as_workload: None,
            into: Some(c.clone()),
        };
        let engine = self.clone();
        let job = tokio::spawn(async move { engine.restore(params, progress).await });
        // A lazy restore reports the tree running before its memory is in; an eager one (all
        // memory came with the images) only ends.
        let pid = match runs.await {
            Ok(outcome) => outcome.pid,
            Err(_) => job.await.map_err(RestoreError::panicked("restore job"))??.pid,
        };
        let inner = self.deps.host.pid_inside(pid, c.init_pid).unwrap_or_default();
        info!(checkpoint = %manifest.id, workload = %name, pid, inner, "restored into its container");
        Ok(PodStart::Restored { checkpoint: manifest.id, pid: inner })
    }
}

/// What a restore into container `c` (on `host`) hands CRIU: the container's stdout and
/// stderr for the pipes the tree wrote to, and how to enter it; and the container's next ids,
/// set above the tree's processes and threads (through `reaper`).
pub(in crate::engine) async fn prepare_restore(
    host: &dyn Containers,
    manifest: &Manifest,
    c: &ContainerRef,
    reaper: &Reaper,
) -> std::io::Result<(Vec<(String, OwnedFd)>, Enter)> {
    let pod = manifest.pod.clone().unwrap_or_default();
    let highest = pod.inner_pids.iter().copied().chain([pod.highest_inner_tid, 1]).max().unwrap_or(1);
    host.reserve_pids(reaper, c.init_pid, highest, &pod.inner_pids).await?;
    Ok((stdio_of(host, c.init_pid, &pod.stdio)?, enter(host, c, true)?))
}

/// The host pid of the restored root that CRIU named `inner` (inside container `c`, on
/// `host`), once it is the container init's child.
pub(in crate::engine) async fn adopted(
    host: &dyn Host,
    c: &ContainerRef,
    inner: i32,
) -> std::io::Result<i32> {
    let deadline = Instant::now() + REPARENT_WAIT;
    loop {
        let children = host.children(c.init_pid);
        if let Some(&pid) = children.iter().find(|&&p| host.pid_inside(p, c.init_pid) == Some(inner)) {
            return Ok(pid);
        }
        if Instant::now() > deadline {
            let why = format!("restored process {inner} did not become the child of the container's init");
            return Err(std::io::Error::other(why));
        }
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
}

/// The new container's stdout and stderr (its init's, copied from `host`) for the pipes the
/// tree's root wrote to in the old one, keyed as CRIU names them (`pipe:[ino]`).
fn stdio_of(
    host: &dyn Containers,
    init: i32,
    recorded: &[String],
) -> std::io::Result<Vec<(String, OwnedFd)>> {
    let mut fds: Vec<(String, OwnedFd)> = Vec::new();
    for (fd, key) in recorded.iter().enumerate().skip(1) {
        if key.starts_with("pipe:") && !fds.iter().any(|(k, _)| k == key) {
            fds.push((key.clone(), host.copy_fd_of(init, fd as i32)?));
        }
    }
    Ok(fds)
}
