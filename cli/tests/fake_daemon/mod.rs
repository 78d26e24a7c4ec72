//! An in-process fake stasisd on a Unix socket, and a harness that runs the `stasis` binary
//! against it.

use std::path::Path;
use std::sync::{Arc, Mutex};

use serde_json::Value;
use stasis_proto::stasis::store::v1::CheckpointStats;
use stasis_proto::stasis::v1::stasis_server::{Stasis, StasisServer};
use stasis_proto::stasis::v1::*;
use stasis_proto::tonic::{self, Request, Response, Status};
use tokio_stream::wrappers::UnixListenerStream;

type Events<T> = tokio_stream::Iter<std::vec::IntoIter<Result<T, Status>>>;

/// Answers every call with fixed data; records `run` requests.
#[derive(Default)]
struct FakeDaemon {
    runs: Arc<Mutex<Vec<RunRequest>>>,
}

fn progress(phase: &str, done_bytes: u64, total_bytes: u64) -> Progress {
    Progress { phase: phase.to_owned(), done_bytes, total_bytes }
}

/// An evacuation noticed at 1_700_000_000_000 with 30 s to go, durable `after_ms` later.
fn evacuation(workload: &str, checkpoint: &str, after_ms: u64) -> Evacuation {
    Evacuation {
        workload: workload.into(),
        cause: "gcp: instance preempted".into(),
        notice_unix_ms: 1_700_000_000_000,
        deadline_unix_ms: 1_700_000_030_000,
        estimate_ms: 3_000,
        checkpoint: checkpoint.into(),
        durable_unix_ms: 1_700_000_000_000 + after_ms,
        error: String::new(),
    }
}

fn info(id: &str) -> CheckpointInfo {
    CheckpointInfo {
        id: id.into(),
        workload: "train".into(),
        pid: 4242,
        created_unix_ms: 1_700_000_000_000,
        bytes_total: 3 << 20,
        command: vec!["sleep".into(), "100".into()],
        ..Default::default()
    }
}

#[tonic::async_trait]
impl Stasis for FakeDaemon {
    type CheckpointStream = Events<CheckpointEvent>;
    type RestoreStream = Events<RestoreEvent>;

    async fn run(&self, req: Request<RunRequest>) -> Result<Response<RunResponse>, Status> {
        let req = req.into_inner();
        let workload = req.workload.clone();
        self.runs.lock().map_err(|_| Status::internal("poisoned"))?.push(req);
        let log_path = format!("/logs/{workload}.log");
        Ok(Response::new(RunResponse { workload, pid: 100, log_path }))
    }

    async fn checkpoint(
        &self,
        req: Request<CheckpointRequest>,
    ) -> Result<Response<Self::CheckpointStream>, Status> {
        use checkpoint_event::Event;
        if req.get_ref().target == Some(checkpoint_request::Target::Pid(13)) {
            return Err(Status::not_found("process 13 does not exist."));
        }
        let stats =
            CheckpointStats { frozen_ms: 12, total_ms: 340, bytes_total: 3 << 20, ..Default::default() };
        let done = CheckpointResult {
            id: "ck-1".into(),
            workload: "train".into(),
            pid: 4242,
            stats: Some(stats),
            left_running: req.get_ref().leave_running,
            // An early (no-wait) answer is not durable yet.
            durable: !req.get_ref().no_wait,
        };
        let events = [Event::Progress(progress("dump", 1, 2)), Event::Done(done)];
        let events = events.map(|e| Ok(CheckpointEvent { event: Some(e) }));
        Ok(Response::new(tokio_stream::iter(events.to_vec())))
    }

    async fn restore(&self, req: Request<RestoreRequest>) -> Result<Response<Self::RestoreStream>, Status> {
        use restore_event::Event;
        let mut events = vec![Event::Progress(progress("fetch", 5, 10))];
        // Workload "cut" ends the stream without a result.
        if req.get_ref().target != Some(restore_request::Target::Workload("cut".into())) {
            let stats = RestoreStats { restore_ms: 80, ..Default::default() };
            let done = RestoreResult {
                id: "ck-1".into(),
                workload: "train".into(),
                pid: 777,
                stats: Some(stats),
                ..Default::default()
            };
            events.push(Event::Done(done));
        }
        let events = events.into_iter().map(|e| Ok(RestoreEvent { event: Some(e) }));
        Ok(Response::new(tokio_stream::iter(events.collect::<Vec<_>>())))
    }

    async fn list(&self, _: Request<ListRequest>) -> Result<Response<ListResponse>, Status> {
        let checkpoints = vec![info("ck-1"), info("ck-2")];
        Ok(Response::new(ListResponse { checkpoints, unreadable: Vec::new() }))
    }

    async fn show(&self, req: Request<ShowRequest>) -> Result<Response<CheckpointInfo>, Status> {
        match req.into_inner().id.as_str() {
            "ck-1" => Ok(Response::new(info("ck-1"))),
            id => Err(Status::not_found(format!("checkpoint {id} does not exist."))),
        }
    }

    async fn export(&self, req: Request<ExportRequest>) -> Result<Response<ExportResponse>, Status> {
        let r = req.into_inner();
        let files = vec!["checkpoint".into(), "config.dump".into()];
        Ok(Response::new(ExportResponse { id: r.id, path: r.path, bytes: 3 << 20, files }))
    }

    async fn import(&self, req: Request<ImportRequest>) -> Result<Response<ImportResponse>, Status> {
        let r = req.into_inner();
        Ok(Response::new(ImportResponse {
            id: "20261123-120000-abcdef".into(),
            workload: if r.workload.is_empty() { "from-archive".into() } else { r.workload },
            engine: "podman".into(),
            kept: vec![r.path],
            bytes_total: 2 << 20,
            bytes_uploaded: 1 << 20,
            restore: "stasis restore hands it to podman".into(),
        }))
    }

    async fn register_container(
        &self,
        req: Request<RegisterContainerRequest>,
    ) -> Result<Response<RegisterContainerResponse>, Status> {
        let r = req.into_inner();
        Ok(Response::new(RegisterContainerResponse {
            workload: format!("k8s.{}.{}", r.namespace, r.container),
        }))
    }

    async fn forget_container(
        &self,
        _: Request<ForgetContainerRequest>,
    ) -> Result<Response<ForgetContainerResponse>, Status> {
        Ok(Response::new(ForgetContainerResponse {}))
    }

    async fn delete(&self, req: Request<DeleteRequest>) -> Result<Response<DeleteResponse>, Status> {
        Ok(Response::new(DeleteResponse { id: req.into_inner().id }))
    }

    async fn gc(&self, req: Request<GcRequest>) -> Result<Response<GcResponse>, Status> {
        let keep = req.into_inner().keep_last as usize;
        let deleted =
            ["ck-0", "ck-1", "ck-2"].into_iter().take(3usize.saturating_sub(keep)).map(String::from);
        Ok(Response::new(GcResponse {
            checkpoints_deleted: deleted.collect(),
            packs_deleted: 2,
            packs_repacked: 1,
            bytes_freed: 5 << 20,
            damaged_packs: Vec::new(),
        }))
    }

    async fn status(&self, _: Request<StatusRequest>) -> Result<Response<StatusResponse>, Status> {
        let workloads = vec![
            WorkloadStatus {
                name: "train".into(),
                pid: 4242,
                running: true,
                command: vec!["sleep".into()],
                state: "running".into(),
                idle_ms: 12_000,
                idle_after_ms: 1_800_000,
                checkpoint_every_ms: 600_000,
                last_checkpoint: "ck-2".into(),
                spot: true,
                evacuation: Some(evacuation("train", "ck-2", 4_200)),
                fitted_every_ms: 192_000,
                ..Default::default()
            },
            WorkloadStatus {
                name: "nb".into(),
                pid: 77,
                command: vec!["python3".into()],
                state: "reclaimed".into(),
                idle_after_ms: 60_000,
                reclaimed_checkpoint: "ck-9".into(),
                ..Default::default()
            },
        ];
        Ok(Response::new(StatusResponse { daemon_version: "9.9".into(), workloads, ..Default::default() }))
    }

    async fn check(&self, req: Request<CheckRequest>) -> Result<Response<CheckResponse>, Status> {
        if !req.into_inner().read_data {
            return Ok(Response::new(CheckResponse { manifests: 2, packs: 3, ..Default::default() }));
        }
        Ok(Response::new(CheckResponse {
            manifests: 2,
            packs: 3,
            chunks_read: 40,
            chunks_by_codec: [("raw".to_string(), 12), ("zstd".to_string(), 28)].into(),
            problems: vec!["chunk ab12 in pack n-1 is corrupt: its content does not match its hash".into()],
            broken: vec![BrokenCheckpoint {
                id: "ck-1".into(),
                reasons: vec!["chunk ab12 in pack n-1 is corrupt".into()],
            }],
            notes: vec![],
        }))
    }

    async fn set_idle(&self, req: Request<SetIdleRequest>) -> Result<Response<SetIdleResponse>, Status> {
        match req.into_inner() {
            r if r.workload == "train" && r.after_ms == 90_000 => Ok(Response::new(SetIdleResponse {})),
            r if r.workload == "train" && r.after_ms == 0 => Ok(Response::new(SetIdleResponse {})),
            r => Err(Status::not_found(format!("unexpected request {r:?}"))),
        }
    }

    async fn set_periodic(
        &self,
        req: Request<SetPeriodicRequest>,
    ) -> Result<Response<SetPeriodicResponse>, Status> {
        match req.into_inner() {
            r if r.workload == "train" && (r.every_ms == 600_000 || r.every_ms == 0) => {
                Ok(Response::new(SetPeriodicResponse {}))
            }
            r => Err(Status::not_found(format!("unexpected request {r:?}"))),
        }
    }

    async fn set_spot(&self, req: Request<SetSpotRequest>) -> Result<Response<SetSpotResponse>, Status> {
        match req.into_inner() {
            r if r.workload == "train" => Ok(Response::new(SetSpotResponse {})),
            r => Err(Status::not_found(format!("unknown workload {:?}", r.workload))),
        }
    }

    async fn evacuate(&self, req: Request<EvacuateRequest>) -> Result<Response<EvacuateResponse>, Status> {
        let req = req.into_inner();
        let mut workloads = vec![evacuation("train", "ck-3", 4_200)];
        if req.within_ms < 30_000 {
            // A window this short: the second one is late, the third fails.
            workloads.push(evacuation("big", "ck-4", 31_300));
            workloads
                .push(Evacuation { error: "dumping workload db failed".into(), ..evacuation("db", "", 0) });
        }
        Ok(Response::new(EvacuateResponse { workloads }))
    }

    async fn wake(&self, req: Request<WakeRequest>) -> Result<Response<RestoreRunning>, Status> {
        let workload = req.into_inner().workload;
        if workload != "nb" {
            return Err(Status::failed_precondition(format!("workload {workload} is not reclaimed")));
        }
        Ok(Response::new(RestoreRunning {
            id: "ck-9".into(),
            workload,
            pid: 77,
            first_run_ms: 180,
            warnings: vec![],
        }))
    }
}

pub struct Output {
    pub code: Option<i32>,
    pub stdout: String,
    pub stderr: String,
}

/// Starts a fake daemon, runs `stasis ARGS` against it (`args` split at spaces), and
/// returns what it printed along with the `run` requests the daemon saw.
pub async fn stasis(args: &str) -> (Output, Vec<RunRequest>) {
    let dir = tempfile::tempdir().expect("temporary directory");
    let socket = dir.path().join("stasisd.sock");
    let listener = tokio::net::UnixListener::bind(&socket).expect("bind the socket");
    let daemon = FakeDaemon::default();
    let runs = Arc::clone(&daemon.runs);
    let server = tokio::spawn(
        tonic::transport::Server::builder()
            .add_service(StasisServer::new(daemon))
            .serve_with_incoming(UnixListenerStream::new(listener)),
    );
    let output = run_binary(&socket, args).await;
    server.abort();
    let runs = runs.lock().expect("run requests").clone();
    (output, runs)
}

async fn run_binary(socket: &Path, args: &str) -> Output {
    let output = tokio::process::Command::new(env!("CARGO_BIN_EXE_stasis"))
        .arg("--socket")
        .arg(socket)
        .args(args.split(' '))
        .output()
        .await
        .expect("run stasis");
    Output {
        code: output.status.code(),
        stdout: String::from_utf8(output.stdout).expect("UTF-8 stdout"),
        stderr: String::from_utf8(output.stderr).expect("UTF-8 stderr"),
    }
}

/// `--json` output: exactly one JSON value on stdout, nothing on stderr.
pub fn json_of(out: &Output) -> Value {
    assert_eq!((out.code, out.stderr.as_str()), (Some(0), ""), "{}", out.stdout);
    serde_json::from_str(&out.stdout).expect("stdout is one JSON value")
}
