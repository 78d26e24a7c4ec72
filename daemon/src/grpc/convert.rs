//! Conversions between the `stasis.v1` messages and the engine's types, and the mapping of
//! engine errors to gRPC status codes.

use std::error::Error;

use stasis_proto::stasis::v1 as pb;
use tonic::{Code, Status};

use crate::cuda::{GpuUuid, parse_uuid};
use crate::engine::pods::PodError;
use crate::engine::{
    Caller, CheckpointError, CheckpointOutcome, CheckpointParams, CheckpointSummary, Evacuation, IdleState,
    Pids, PolicyError, ProgressUpdate, QueryError, RestoreError, RestoreOutcome, RestoreParams,
    RestoreTarget, RunError, RunOutcome, RunParams, StatusReport, Target, WorkloadReport,
};
use crate::store::{CheckReport, GcReport, StoreError};

pub(super) fn status(code: Code, err: &dyn Error) -> Status {
    Status::new(code, crate::error_chain(err))
}

pub(super) fn store_code(e: &StoreError) -> Code {
    match e {
        StoreError::NotFound(_) => Code::NotFound,
        StoreError::Envelope { .. }
        | StoreError::Corrupt { .. }
        | StoreError::CorruptChunk { .. }
        | StoreError::MissingChunk { .. }
        | StoreError::MissingPack { .. }
        | StoreError::Images(_)
        | StoreError::Parent(_)
        | StoreError::Unreadable { .. } => Code::DataLoss,
        StoreError::Backend { .. } | StoreError::Lease { .. } | StoreError::Busy(_) => Code::Unavailable,
        StoreError::Local { .. } | StoreError::DumpUnfinished => Code::Internal,
    }
}

impl From<RunError> for Status {
    fn from(e: RunError) -> Self {
        let code = match &e {
            RunError::NoCommand | RunError::BadName(_) => Code::InvalidArgument,
            RunError::AlreadyRunning { .. } | RunError::Reclaimed(_) => Code::AlreadyExists,
            RunError::NameTaken(_) | RunError::ContainerName(_) => Code::PermissionDenied,
            RunError::Spawn { source, .. } if source.kind() == std::io::ErrorKind::NotFound => Code::NotFound,
            RunError::Spawn { .. } | RunError::Setup { .. } => Code::Internal,
        };
        status(code, &e)
    }
}

impl From<CheckpointError> for Status {
    fn from(e: CheckpointError) -> Self {
        let code = match &e {
            CheckpointError::NoSuchProcess(_) | CheckpointError::UnknownWorkload(_) => Code::NotFound,
            CheckpointError::NotYours { .. } => Code::PermissionDenied,
            CheckpointError::NotRunning { .. }
            | CheckpointError::Sockets { .. }
            | CheckpointError::Untouchable { .. }
            | CheckpointError::Container { .. }
            | CheckpointError::NoTime { .. } => Code::FailedPrecondition,
            CheckpointError::Dump { .. }
            | CheckpointError::Lost { .. }
            | CheckpointError::PageServer { .. } => Code::Aborted,
            CheckpointError::Store { source, .. } => store_code(source),
            CheckpointError::ShuttingDown => Code::Unavailable,
            CheckpointError::Gpu(_) => Code::FailedPrecondition,
            CheckpointError::Inspect { .. }
            | CheckpointError::Local { .. }
            | CheckpointError::Panicked { .. }
            | CheckpointError::Rollback { .. } => Code::Internal,
        };
        status(code, &e)
    }
}

impl From<PodError> for Status {
    fn from(e: PodError) -> Self {
        let code = match &e {
            PodError::BadIdentity(_) => Code::InvalidArgument,
            PodError::NoInit(_) | PodError::UnknownCaller => Code::NotFound,
            PodError::NotOneTree { .. } | PodError::SharedPids(_) => Code::FailedPrecondition,
            PodError::Registry { .. } => Code::Internal,
        };
        status(code, &e)
    }
}

impl From<RestoreError> for Status {
    fn from(e: RestoreError) -> Self {
        status(restore_code(&e), &e)
    }
}

fn restore_code(e: &RestoreError) -> Code {
    match e {
        RestoreError::BadId(_) | RestoreError::BadName { .. } => Code::InvalidArgument,
        RestoreError::Reclaimed(_) => Code::FailedPrecondition,
        RestoreError::NotYours(_) => Code::PermissionDenied,
        RestoreError::NoCheckpoints(_) => Code::NotFound,
        RestoreError::Store(s) => store_code(s),
        RestoreError::PidsInUse { .. } | RestoreError::Sockets { .. } | RestoreError::Incompatible { .. } => {
            Code::FailedPrecondition
        }
        RestoreError::Criu { .. } | RestoreError::Runtime { .. } => Code::Aborted,
        RestoreError::ShuttingDown => Code::Unavailable,
        RestoreError::Gpu { .. } => Code::Internal,
        RestoreError::GpuPlacement { .. } => Code::FailedPrecondition,
        RestoreError::Local { .. } | RestoreError::Panicked { .. } => Code::Internal,
        RestoreError::LazyStart { .. } => Code::Internal,
        RestoreError::Lazy { .. } | RestoreError::LazyDuringRestore { .. } => Code::Aborted,
    }
}

impl From<PolicyError> for Status {
    fn from(e: PolicyError) -> Self {
        let code = match &e {
            PolicyError::UnknownWorkload(_) => Code::NotFound,
            PolicyError::NotReclaimed(_) => Code::FailedPrecondition,
            PolicyError::NotYours(_) | PolicyError::RootOnly(_) => Code::PermissionDenied,
            PolicyError::Wake { source, .. } => restore_code(source),
            PolicyError::WokenElsewhere(_) => Code::Aborted,
            PolicyError::Registry(_) => Code::Internal,
        };
        status(code, &e)
    }
}

impl From<QueryError> for Status {
    fn from(e: QueryError) -> Self {
        let code = match &e {
            QueryError::BadId(_) => Code::InvalidArgument,
            QueryError::NotYours(_) | QueryError::RootOnly(_) => Code::PermissionDenied,
            QueryError::Reclaimed { .. } => Code::FailedPrecondition,
            QueryError::Store(s) => store_code(s),
        };
        status(code, &e)
    }
}

impl TryFrom<pb::RunRequest> for RunParams {
    type Error = Status;

    fn try_from(r: pb::RunRequest) -> Result<Self, Status> {
        let env = r
            .env
            .iter()
            .map(|kv| {
                kv.split_once('=')
                    .filter(|(k, _)| !k.is_empty() && !kv.contains('\0'))
                    .map(|(k, v)| (k.to_string(), v.to_string()))
                    .ok_or_else(|| {
                        let shown: String = kv.chars().take(60).collect();
                        Status::invalid_argument(format!(
                            "environment entry {shown:?} is not KEY=VALUE (a non-empty key, no NUL)"
                        ))
                    })
            })
            .collect::<Result<_, _>>()?;
        Ok(Self {
            workload: Some(r.workload).filter(|w| !w.is_empty()),
            argv: r.argv,
            cwd: Some(r.cwd).filter(|c| !c.is_empty()).map(Into::into),
            env,
            idle_after: (r.idle_after_ms > 0).then(|| std::time::Duration::from_millis(r.idle_after_ms)),
            checkpoint_every: (r.checkpoint_every_ms > 0)
                .then(|| std::time::Duration::from_millis(r.checkpoint_every_ms)),
            spot: r.spot,
            pids: match (r.host_pids, r.own_pids) {
                (true, true) => {
                    return Err(Status::invalid_argument("host_pids and own_pids exclude each other"));
                }
                (true, false) => Pids::Host,
                (false, true) => Pids::Own,
                (false, false) => Pids::Default,
            },
            caller: Caller::Root,
        })
    }
}

impl From<RunOutcome> for pb::RunResponse {
    fn from(o: RunOutcome) -> Self {
        Self { workload: o.workload, pid: o.pid, log_path: o.log_path.display().to_string() }
    }
}

impl TryFrom<pb::CheckpointRequest> for CheckpointParams {
    type Error = Status;

    fn try_from(r: pb::CheckpointRequest) -> Result<Self, Status> {
        let target = match r.target {
            Some(pb::checkpoint_request::Target::Pid(pid)) if pid > 0 => Target::Pid(pid),
            Some(pb::checkpoint_request::Target::Pid(pid)) => {
                return Err(Status::invalid_argument(format!("{pid} is not a valid process id")));
            }
            Some(pb::checkpoint_request::Target::Workload(w)) => Target::Workload(w),
            None => {
                return Err(Status::invalid_argument("give a process id or a workload name"));
            }
        };
        Ok(Self {
            target,
            leave_running: r.leave_running,
            answer_early: None,
            reclaim: None,
            caller: Caller::Root,
        })
    }
}

impl TryFrom<pb::RestoreRequest> for RestoreParams {
    type Error = Status;

    fn try_from(r: pb::RestoreRequest) -> Result<Self, Status> {
        let target = match r.target {
            Some(pb::restore_request::Target::CheckpointId(id)) => RestoreTarget::Checkpoint(id),
            Some(pb::restore_request::Target::Workload(w)) => RestoreTarget::Workload(w),
            None => {
                return Err(Status::invalid_argument("give a checkpoint id or a workload name"));
            }
        };
        let gpu_map = r.gpu_map.iter().map(|pair| parse_gpu_pair(pair)).collect::<Result<_, _>>()?;
        Ok(Self {
            target,
            gpu_map,
            lazy: r.lazy,
            tcp_close: r.tcp_close,
            on_running: None,
            caller: Caller::Root,
            as_workload: Some(r.as_workload).filter(|w| !w.is_empty()),
            into: None,
        })
    }
}

/// Parses "OLD-UUID=NEW-UUID".
fn parse_gpu_pair(pair: &str) -> Result<(GpuUuid, GpuUuid), Status> {
    let bad = |why: String| Status::invalid_argument(format!("--gpu-map entry {pair:?}: {why}"));
    let (old, new) = pair.split_once('=').ok_or_else(|| bad("expected OLD=NEW".into()))?;
    Ok((parse_uuid(old).map_err(|e| bad(e.to_string()))?, parse_uuid(new).map_err(|e| bad(e.to_string()))?))
}

impl From<ProgressUpdate> for pb::Progress {
    fn from(p: ProgressUpdate) -> Self {
        Self { phase: p.phase.into(), done_bytes: p.done, total_bytes: p.total }
    }
}

impl From<CheckpointOutcome> for pb::CheckpointResult {
    fn from(o: CheckpointOutcome) -> Self {
        Self {
            stats: Some(o.stats),
            id: o.id,
            workload: o.workload,
            pid: o.pid,
            left_running: o.left_running,
            durable: o.durable,
        }
    }
}

impl From<RestoreOutcome> for pb::RestoreResult {
    fn from(o: RestoreOutcome) -> Self {
        let s = o.stats;
        Self {
            id: o.id,
            workload: o.workload,
            pid: o.pid,
            warnings: o.warnings,
            stats: Some(pb::RestoreStats {
                restore_ms: s.restore_ms,
                fetch_ms: s.fetch_ms,
                criu_ms: s.criu_ms,
                bytes_fetched: s.bytes_fetched,
                gpu_restore_ms: s.gpu_restore_ms,
                first_run_ms: s.first_run_ms,
                resident_ms: s.resident_ms,
                lazy: s.lazy,
            }),
        }
    }
}

impl From<CheckpointSummary> for pb::CheckpointInfo {
    fn from(c: CheckpointSummary) -> Self {
        Self {
            stats: Some(c.stats),
            id: c.id,
            workload: c.workload,
            pid: c.pid,
            created_unix_ms: c.created_unix_ms,
            bytes_total: c.bytes_total,
            node: c.node,
            kernel: c.kernel,
            criu_version: c.criu_version,
            command: c.command,
            pids: c.pids,
            files: c.files,
            criu_options: c.criu_options,
            sockets: c.sockets,
            imported_from: c.imported_from,
        }
    }
}

/// The store's report of a collection, as the API answers it (both types are other crates',
/// hence a function and not `From`).
pub(super) fn gc_response(r: GcReport) -> pb::GcResponse {
    pb::GcResponse {
        checkpoints_deleted: r.manifests_deleted,
        packs_deleted: r.packs_deleted,
        packs_repacked: r.packs_repacked,
        bytes_freed: r.bytes_freed,
        damaged_packs: r.damaged_packs,
    }
}

impl From<StatusReport> for pb::StatusResponse {
    fn from(r: StatusReport) -> Self {
        Self {
            daemon_version: r.daemon_version,
            criu_version: r.criu_version,
            criu_path: r.criu_path,
            kernel: r.kernel,
            gpu_support: r.gpu_support,
            store_url: r.store_url,
            state_dir: r.state_dir,
            socket_support: r.socket_support,
            network_lock: r.network_lock,
            memory_tracking: r.memory_tracking,
            compression: r.compression,
            // The service fills it in: the engine does not watch for notices itself.
            notices: String::new(),
            workloads: r
                .workloads
                .into_iter()
                .map(|WorkloadReport { workload: w, running, idle, fitted_every }| {
                    let (state, idle_ms) = match (idle, running) {
                        (IdleState::Reclaiming, _) => ("reclaiming", 0),
                        (IdleState::Reclaimed, _) => ("reclaimed", 0),
                        (IdleState::Waking, _) => ("waking", 0),
                        (IdleState::Watched(idle), true) => ("running", idle.as_millis() as u64),
                        (_, true) => ("running", 0),
                        (_, false) => ("stopped", 0),
                    };
                    pb::WorkloadStatus {
                        name: w.name,
                        pid: w.pid,
                        running,
                        command: w.command,
                        last_error: w.last_error.unwrap_or_default(),
                        state: state.into(),
                        idle_ms,
                        idle_after_ms: w.idle_after_ms.unwrap_or_default(),
                        reclaimed_checkpoint: w.reclaimed.map(|r| r.checkpoint).unwrap_or_default(),
                        checkpoint_every_ms: w.checkpoint_every_ms.unwrap_or_default(),
                        last_checkpoint: w.last_checkpoint.unwrap_or_default(),
                        spot: w.spot,
                        fitted_every_ms: fitted_every.map_or(0, |d| d.as_millis() as u64),
                        evacuation: w.evacuation.map(Into::into),
                        log_path: w.log_path.map(|p| p.display().to_string()).unwrap_or_default(),
                        container: w.container.map(|c| c.id).unwrap_or_default(),
                    }
                })
                .collect(),
        }
    }
}

impl From<Evacuation> for pb::Evacuation {
    fn from(e: Evacuation) -> Self {
        Self {
            workload: e.workload,
            cause: e.cause,
            notice_unix_ms: e.notice_unix_ms,
            deadline_unix_ms: e.deadline_unix_ms,
            estimate_ms: e.estimate_ms,
            checkpoint: e.checkpoint.unwrap_or_default(),
            durable_unix_ms: e.durable_unix_ms.unwrap_or_default(),
            error: e.error.unwrap_or_default(),
        }
    }
}

/// A (lazily) restored tree runs: what the caller learns before its memory is in.
impl From<RestoreOutcome> for pb::RestoreRunning {
    fn from(o: RestoreOutcome) -> Self {
        Self {
            id: o.id,
            workload: o.workload,
            pid: o.pid,
            first_run_ms: o.stats.first_run_ms,
            warnings: o.warnings,
        }
    }
}

/// The store's report of a check, as the API answers it.
pub(super) fn check_response(r: CheckReport) -> pb::CheckResponse {
    pb::CheckResponse {
        manifests: r.manifests as u64,
        packs: r.packs as u64,
        chunks_read: r.chunks_read,
        chunks_by_codec: r.chunks_by_codec.into_iter().collect(),
        problems: r.problems,
        broken: r.broken.into_iter().map(|(id, reasons)| pb::BrokenCheckpoint { id, reasons }).collect(),
        notes: r.notes,
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn requests_without_target_are_invalid() {
        let e = CheckpointParams::try_from(pb::CheckpointRequest::default()).unwrap_err();
        assert_eq!(e.code(), Code::InvalidArgument);
        let e = CheckpointParams::try_from(pb::CheckpointRequest {
            target: Some(pb::checkpoint_request::Target::Pid(-3)),
            leave_running: false,
            no_wait: false,
        })
        .unwrap_err();
        assert!(e.message().contains("-3"));
        assert_eq!(
            RestoreParams::try_from(pb::RestoreRequest::default()).unwrap_err().code(),
            Code::InvalidArgument
        );
        let bad_env =
            pb::RunRequest { argv: vec!["x".into()], env: vec!["NOEQUALS".into()], ..Default::default() };
        assert!(RunParams::try_from(bad_env).unwrap_err().message().contains("NOEQUALS"));
    }

    #[test]
    fn errors_map_to_codes_with_their_causes() {
        let s: Status = RestoreError::Store(StoreError::Corrupt {
            id: "i".into(),
            file: "pages-1.img".into(),
            reason: "truncated".into(),
        })
        .into();
        assert_eq!(s.code(), Code::DataLoss);
        assert!(s.message().contains("pages-1.img"));
        let s: Status = CheckpointError::NoSuchProcess(99999).into();
        assert_eq!((s.code(), s.message()), (Code::NotFound, "process 99999 does not exist"));
    }
}
