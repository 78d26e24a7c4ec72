//! Errors of the engine's operations. Messages are full sentences meant for the user of the
//! CLI; the gRPC adapter maps each to a status code.

use std::io;
use std::path::PathBuf;

use crate::criu::{CriuError, CriuVersion};
use crate::store::{OpenStoreError, StoreError};

/// The engine could not start.
#[derive(Debug, thiserror::Error)]
pub enum StartError {
    #[error(
        "CRIU not found at {0}: run scripts/setup-criu.sh (it installs CRIU 4.2 under .stasis/criu \
         without touching system packages), install CRIU 4.0 or newer, or pass --criu PATH"
    )]
    CriuMissing(PathBuf),
    #[error("cannot query CRIU at {path}")]
    CriuUnusable {
        path: PathBuf,
        #[source]
        source: CriuError,
    },
    #[error(
        "CRIU {version} at {path} is too old: stasis needs CRIU 4.0 or newer; run \
         scripts/setup-criu.sh or pass --criu PATH"
    )]
    CriuTooOld { path: PathBuf, version: CriuVersion },
    #[error("`criu check` fails on this kernel with CRIU at {path}; see CRIU's log below")]
    CriuCheck {
        path: PathBuf,
        #[source]
        source: CriuError,
    },
    #[error("the {lock} network lock was asked for, but {why}")]
    NetworkLock { lock: &'static str, why: String },
    #[error("cannot open the store")]
    Store(#[from] OpenStoreError),
    #[error("cannot use the state directory {path}")]
    State {
        path: PathBuf,
        #[source]
        source: io::Error,
    },
    #[error("cannot become the reaper of restored processes")]
    Reaper(#[source] io::Error),
    #[error("a start-up task of stasisd failed")]
    Task(#[source] tokio::task::JoinError),
}

/// `run` failed.
#[derive(Debug, thiserror::Error)]
pub enum RunError {
    #[error("no command given")]
    NoCommand,
    #[error("invalid workload name {0:?}: use up to 100 letters, digits, '-', '_' or '.'")]
    BadName(String),
    #[error("workload {name} is already running as pid {pid}")]
    AlreadyRunning { name: String, pid: i32 },
    #[error("workload {0} is reclaimed (idle); `stasis wake {0}` brings it back")]
    Reclaimed(String),
    #[error("the workload name {0} is another user's")]
    NameTaken(String),
    #[error("the workload name {0} is a Kubernetes container's: names beginning with k8s. are root's")]
    ContainerName(String),
    #[error("cannot prepare {what} for workload {workload}")]
    Setup {
        workload: String,
        what: &'static str,
        #[source]
        source: io::Error,
    },
    #[error("cannot start {program:?}")]
    Spawn {
        program: String,
        #[source]
        source: io::Error,
    },
}

/// `checkpoint` failed. Every variant leaves the workload running unless it says otherwise.
#[derive(Debug, thiserror::Error)]
pub enum CheckpointError {
    #[error("process {0} does not exist")]
    NoSuchProcess(i32),
    #[error("process {pid} cannot be checkpointed: {reason}; nothing was touched")]
    Untouchable { pid: i32, reason: String },
    #[error("unknown workload {0:?}")]
    UnknownWorkload(String),
    #[error(
        "process tree of pid {pid} is not yours (its processes run as user ids {uids:?}); you may \
         checkpoint only trees whose every process runs as you; nothing was touched"
    )]
    NotYours { pid: i32, uids: Vec<u32> },
    #[error("workload {workload} is not running (its last pid {pid} is gone)")]
    NotRunning { workload: String, pid: i32 },
    #[error("cannot inspect process tree of pid {pid}")]
    Inspect {
        pid: i32,
        #[source]
        source: io::Error,
    },
    #[error("dumping workload {workload} failed; it was left running")]
    Dump {
        workload: String,
        #[source]
        source: CriuError,
    },
    /// CRIU failed and the tree died with it: CRIU runs code of its own inside each process
    /// it dumps, and a CRIU killed while that code runs leaves the process to die of its trap.
    #[error(
        "dumping workload {workload} failed and its processes died with the dump; nothing holds \
         the state they had (a CRIU that dies while its code runs inside a process takes the \
         process with it)"
    )]
    Lost {
        workload: String,
        #[source]
        source: CriuError,
    },
    #[error(
        "workload {workload} cannot be made durable in the time left (about {needs:?} needed, \
         {left:?} left); it was left running untouched"
    )]
    NoTime { workload: String, needs: std::time::Duration, left: std::time::Duration },
    #[error("workload {workload}'s container cannot be checkpointed; nothing was touched")]
    Container {
        workload: String,
        #[source]
        source: super::pods::PodError,
    },
    #[error("receiving the pages of workload {workload} failed; it was left running")]
    PageServer {
        workload: String,
        #[source]
        source: crate::criu::pageserver::PageServerError,
    },
    #[error("storing checkpoint {id} failed; the workload was resumed and left running")]
    Store {
        id: String,
        #[source]
        source: Box<StoreError>,
    },
    #[error("workload {workload} cannot be checkpointed: {reason}; it was left running untouched")]
    Sockets { workload: String, reason: String },
    #[error("local {what} failed; the workload was left running")]
    Local {
        what: &'static str,
        #[source]
        source: io::Error,
    },
    #[error("stasisd's {what} {how}: a bug in stasisd; the workload was left running")]
    Panicked { what: &'static str, how: String },
    #[error(transparent)]
    Gpu(#[from] super::gpu::GpuError),
    #[error("stasisd is shutting down; no new jobs are accepted")]
    ShuttingDown,
    #[error("the checkpoint failed, and undoing it was incomplete ({})", .problems.join("; "))]
    Rollback {
        #[source]
        cause: Box<CheckpointError>,
        problems: Vec<String>,
    },
}

impl CheckpointError {
    /// `cause`, with what its rollback could not undo, if anything.
    pub fn with_rollback(cause: CheckpointError, problems: Vec<String>) -> CheckpointError {
        match problems.is_empty() {
            true => cause,
            false => CheckpointError::Rollback { cause: Box::new(cause), problems },
        }
    }
}

/// `restore` failed. Nothing partly restored is left running.
#[derive(Debug, thiserror::Error)]
pub enum RestoreError {
    #[error("{0:?} is not a checkpoint id (expected YYYYMMDD-HHMMSS-xxxxxx)")]
    BadId(String),
    #[error(
        "workload {0} is reclaimed (idle) and stasisd holds its ports for it: `stasis wake {0}` \
         restores it"
    )]
    Reclaimed(String),
    #[error("checkpoint {0} is not yours; nothing was restored")]
    NotYours(String),
    #[error("workload {0:?} has no checkpoints")]
    NoCheckpoints(String),
    #[error(transparent)]
    Store(#[from] StoreError),
    #[error(
        "cannot restore checkpoint {id}: process ids {pids:?} are in use (is the checkpointed \
         tree still running? stop it first)"
    )]
    PidsInUse { id: String, pids: Vec<i32> },
    #[error("cannot restore checkpoint {id} on this node: {reason}; nothing was restored")]
    Sockets { id: String, reason: String },
    #[error("cannot restore checkpoint {id} on this node: {reason}; nothing was restored")]
    Incompatible { id: String, reason: String },
    #[error("cannot restore as workload {name:?}: {why}")]
    BadName { name: String, why: &'static str },
    #[error("{runtime} could not restore checkpoint {id}: {why}")]
    Runtime { id: String, runtime: &'static str, why: String },
    #[error("CRIU could not restore checkpoint {id}")]
    Criu {
        id: String,
        #[source]
        source: CriuError,
    },
    #[error("local {what} failed")]
    Local {
        what: &'static str,
        #[source]
        source: io::Error,
    },
    #[error("stasisd's {what} {how}: a bug in stasisd")]
    Panicked { what: &'static str, how: String },
    #[error("checkpoint {id} cannot be restored on this node's GPUs; nothing was restored")]
    GpuPlacement {
        id: String,
        #[source]
        source: Box<super::gpu_map::GpuMapError>,
    },
    #[error("GPU restore of checkpoint {id} failed; the restored tree was stopped")]
    Gpu {
        id: String,
        #[source]
        source: super::gpu::GpuError,
    },
    #[error("stasisd is shutting down; no new jobs are accepted")]
    ShuttingDown,
    #[error("{} of checkpoint {id} could not start; nothing was restored", served(*lazy))]
    LazyStart {
        id: String,
        lazy: bool,
        #[source]
        source: super::hot_restore::LazyError,
    },
    #[error(
        "{} of checkpoint {id} failed while CRIU restored the tree (CRIU: {criu}), because its \
         memory could not be served; nothing was restored",
        served(*lazy)
    )]
    LazyDuringRestore {
        id: String,
        lazy: bool,
        #[source]
        source: super::hot_restore::LazyError,
        criu: Box<CriuError>,
    },
    #[error(
        "{} of checkpoint {id} failed before all memory arrived; the restored tree (pid {pid}) \
         was killed",
        served(*lazy)
    )]
    Lazy {
        id: String,
        lazy: bool,
        pid: i32,
        #[source]
        source: super::hot_restore::LazyError,
    },
}

/// What a restore whose memory stasisd serves is called: lazy, or plain (eager).
fn served(lazy: bool) -> &'static str {
    if lazy { "lazy restore" } else { "restore" }
}

impl RestoreError {
    /// An error naming the local `what` that failed.
    pub(super) fn local(what: &'static str) -> impl Fn(io::Error) -> Self {
        move |source| Self::Local { what, source }
    }

    /// The error of `what`, a task or thread that ended without its result.
    pub(super) fn panicked(what: &'static str) -> impl Fn(tokio::task::JoinError) -> Self {
        move |e| Self::Panicked { what, how: how_it_ended(e) }
    }
}

impl CheckpointError {
    /// The error of `what`, a task or thread that ended without its result.
    pub(super) fn panicked(what: &'static str) -> impl Fn(tokio::task::JoinError) -> Self {
        move |e| Self::Panicked { what, how: how_it_ended(e) }
    }
}

/// How a task that gave no result ended: `panicked: <its message>`, or `was cancelled`.
fn how_it_ended(e: tokio::task::JoinError) -> String {
    let Ok(payload) = e.try_into_panic() else { return "was cancelled".into() };
    // A panic's payload is its message: a &str for a literal, a String for a formatted one.
    match payload
        .downcast_ref::<&str>()
        .map(|s| s.to_string())
        .or_else(|| payload.downcast_ref::<String>().cloned())
    {
        Some(message) => format!("panicked: {message}"),
        None => "panicked".into(),
    }
}

/// `list`, `show` or `delete` failed.
#[derive(Debug, thiserror::Error)]
pub enum QueryError {
    #[error("{0:?} is not a checkpoint id (expected YYYYMMDD-HHMMSS-xxxxxx)")]
    BadId(String),
    #[error("checkpoint {0} is not yours")]
    NotYours(String),
    #[error("{0} is root's alone")]
    RootOnly(&'static str),
    #[error("checkpoint {id} is what reclaimed workload {workload} wakes from: wake it first")]
    Reclaimed { id: String, workload: String },
    #[error(transparent)]
    Store(#[from] StoreError),
}

/// Setting a workload's idle or periodic-checkpoint policy, or waking it, failed.
#[derive(Debug, thiserror::Error)]
pub enum PolicyError {
    #[error("unknown workload {0:?}")]
    UnknownWorkload(String),
    #[error("workload {0} is not yours")]
    NotYours(String),
    #[error("workload {0} is not reclaimed; there is nothing to wake")]
    NotReclaimed(String),
    #[error("waking workload {workload} failed; it stays reclaimed, its checkpoint restorable")]
    Wake {
        workload: String,
        #[source]
        source: std::sync::Arc<RestoreError>,
    },
    #[error("workload {0} was woken by something else meanwhile")]
    WokenElsewhere(String),
    #[error("only root may {0}")]
    RootOnly(&'static str),
    #[error("cannot update the workload registry")]
    Registry(#[source] io::Error),
}

#[cfg(test)]
mod tests {
    use super::*;

    #[tokio::test]
    async fn a_panicked_task_is_reported_as_one_with_its_message() {
        let panicked = tokio::spawn(async { panic!("the index was {}", 7) }).await.unwrap_err();
        let e = CheckpointError::panicked("dump thread")(panicked);
        assert_eq!(
            e.to_string(),
            "stasisd's dump thread panicked: the index was 7: a bug in stasisd; the workload was left running"
        );
        let task = tokio::spawn(std::future::pending::<()>());
        task.abort();
        let e = RestoreError::panicked("restore job")(task.await.unwrap_err());
        assert_eq!(e.to_string(), "stasisd's restore job was cancelled: a bug in stasisd");
    }
}
