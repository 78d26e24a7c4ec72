//! The `stasis.v1` gRPC service: a thin adapter that converts messages, calls the engine, and
//! streams progress of long operations.

mod archive;
mod caller;
mod convert;

use std::pin::Pin;
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use futures::Stream;
use stasis_proto::stasis::v1 as pb;
use stasis_proto::stasis::v1::stasis_server::Stasis;
pub use stasis_proto::stasis::v1::stasis_server::StasisServer;
use tokio::sync::mpsc;
use tokio_stream::wrappers::UnboundedReceiverStream;
use tonic::{Request, Response, Status};

use crate::engine::pods::{ContainerRef, Identity, Registration};
use crate::engine::{Caller, Engine, EvacuateParams, PolicyError, ProgressFn, ProgressUpdate};
use caller::caller_of;

/// Progress events are sent at most this often (plus every change of phase).
const PROGRESS_INTERVAL: Duration = Duration::from_millis(200);

type EventStream<T> = Pin<Box<dyn Stream<Item = Result<T, Status>> + Send>>;

/// The service over an [`Engine`].
pub struct StasisService {
    engine: Arc<Engine>,
    /// Which preemption notices stasisd watches for, as `stasis status` shows it.
    notices: String,
}

impl StasisService {
    pub fn new(engine: Arc<Engine>, notices: String) -> Self {
        Self { engine, notices }
    }
}

/// A progress callback that forwards throttled updates into `tx` as events built by `wrap`.
fn progress_sender<T: Send + 'static>(
    tx: mpsc::UnboundedSender<Result<T, Status>>,
    wrap: fn(pb::Progress) -> T,
) -> ProgressFn {
    let last: Mutex<Option<(&'static str, Instant)>> = Mutex::new(None);
    Arc::new(move |update: ProgressUpdate| {
        let mut last = last.lock().unwrap_or_else(|p| p.into_inner());
        let due = match *last {
            Some((phase, at)) => {
                phase != update.phase || at.elapsed() >= PROGRESS_INTERVAL || update.done == update.total
            }
            None => true,
        };
        if due {
            *last = Some((update.phase, Instant::now()));
            let _ = tx.send(Ok(wrap(update.into())));
        }
    })
}

#[tonic::async_trait]
impl Stasis for StasisService {
    type CheckpointStream = EventStream<pb::CheckpointEvent>;
    type RestoreStream = EventStream<pb::RestoreEvent>;

    async fn run(&self, req: Request<pb::RunRequest>) -> Result<Response<pb::RunResponse>, Status> {
        let caller = caller_of(&req)?;
        let mut params: crate::engine::RunParams = req.into_inner().try_into()?;
        params.caller = caller;
        Ok(Response::new(self.engine.run(params)?.into()))
    }

    async fn checkpoint(
        &self,
        req: Request<pb::CheckpointRequest>,
    ) -> Result<Response<Self::CheckpointStream>, Status> {
        use pb::checkpoint_event::Event;
        let caller = caller_of(&req)?;
        let req = req.into_inner();
        let no_wait = req.no_wait;
        let mut params: crate::engine::CheckpointParams = req.try_into()?;
        params.caller = caller;
        let (tx, rx) = mpsc::unbounded_channel();
        if no_wait {
            // The early answer is the stream's result; the job goes on after it.
            let early = tx.clone();
            let send = Box::new(move |o: crate::engine::CheckpointOutcome| {
                let _ = early.send(Ok(pb::CheckpointEvent { event: Some(Event::Done(o.into())) }));
            });
            params.answer_early =
                Some(crate::engine::EarlyAnswer { when: crate::engine::AnswerWhen::Resumed, send });
        }
        let progress =
            progress_sender(tx.clone(), |p| pb::CheckpointEvent { event: Some(Event::Progress(p)) });
        let engine = self.engine.clone();
        tokio::spawn(async move {
            let result = engine.checkpoint(params, progress).await;
            let event = result.map(|o| pb::CheckpointEvent { event: Some(Event::Done(o.into())) });
            let _ = tx.send(event.map_err(Status::from));
        });
        Ok(Response::new(Box::pin(UnboundedReceiverStream::new(rx))))
    }

    async fn restore(
        &self,
        req: Request<pb::RestoreRequest>,
    ) -> Result<Response<Self::RestoreStream>, Status> {
        use pb::restore_event::Event;
        let caller = caller_of(&req)?;
        let mut params: crate::engine::RestoreParams = req.into_inner().try_into()?;
        params.caller = caller;
        let (tx, rx) = mpsc::unbounded_channel();
        let running = tx.clone();
        params.on_running = Some(Box::new(move |o| {
            let _ = running.send(Ok(pb::RestoreEvent { event: Some(Event::Running(o.into())) }));
        }));
        let progress = progress_sender(tx.clone(), |p| pb::RestoreEvent { event: Some(Event::Progress(p)) });
        let engine = self.engine.clone();
        tokio::spawn(async move {
            let result = engine.restore(params, progress).await;
            let event = result.map(|o| pb::RestoreEvent { event: Some(Event::Done(o.into())) });
            let _ = tx.send(event.map_err(Status::from));
        });
        Ok(Response::new(Box::pin(UnboundedReceiverStream::new(rx))))
    }

    async fn list(&self, req: Request<pb::ListRequest>) -> Result<Response<pb::ListResponse>, Status> {
        let caller = caller_of(&req)?;
        let workload = Some(req.into_inner().workload).filter(|w| !w.is_empty());
        let list = self.engine.list(workload.as_deref(), caller).await?;
        let checkpoints = list.checkpoints.into_iter().map(Into::into).collect();
        Ok(Response::new(pb::ListResponse { checkpoints, unreadable: list.unreadable }))
    }

    async fn show(&self, req: Request<pb::ShowRequest>) -> Result<Response<pb::CheckpointInfo>, Status> {
        let caller = caller_of(&req)?;
        Ok(Response::new(self.engine.show(&req.into_inner().id, caller).await?.into()))
    }

    async fn delete(&self, req: Request<pb::DeleteRequest>) -> Result<Response<pb::DeleteResponse>, Status> {
        let caller = caller_of(&req)?;
        let id = req.into_inner().id;
        self.engine.delete(&id, caller).await?;
        Ok(Response::new(pb::DeleteResponse { id }))
    }

    async fn gc(&self, req: Request<pb::GcRequest>) -> Result<Response<pb::GcResponse>, Status> {
        let caller = caller_of(&req)?;
        let keep_last = match req.into_inner().keep_last {
            0 => None,
            n => Some(n as usize),
        };
        Ok(Response::new(convert::gc_response(self.engine.gc(keep_last, caller).await?)))
    }

    async fn export(&self, req: Request<pb::ExportRequest>) -> Result<Response<pb::ExportResponse>, Status> {
        let caller = caller_of(&req)?;
        let r = req.into_inner();
        let compression = crate::engine::archive::Compression::parse(&r.compression).ok_or_else(|| {
            Status::invalid_argument(format!("unknown compression {:?}: zstd, gzip or none", r.compression))
        })?;
        let outcome = self.engine.export(&r.id, std::path::Path::new(&r.path), compression, caller).await?;
        Ok(Response::new(outcome.into()))
    }

    async fn import(&self, req: Request<pb::ImportRequest>) -> Result<Response<pb::ImportResponse>, Status> {
        let caller = caller_of(&req)?;
        let r = req.into_inner();
        let workload = Some(r.workload.as_str()).filter(|w| !w.is_empty());
        let outcome = self.engine.import(std::path::Path::new(&r.path), workload, caller).await?;
        Ok(Response::new(outcome.into()))
    }

    async fn status(&self, req: Request<pb::StatusRequest>) -> Result<Response<pb::StatusResponse>, Status> {
        let mut status: pb::StatusResponse = self.engine.status(caller_of(&req)?).into();
        status.notices = self.notices.clone();
        Ok(Response::new(status))
    }

    async fn check(&self, req: Request<pb::CheckRequest>) -> Result<Response<pb::CheckResponse>, Status> {
        let caller = caller_of(&req)?;
        Ok(Response::new(convert::check_response(
            self.engine.check(req.into_inner().read_data, caller).await?,
        )))
    }

    async fn set_idle(
        &self,
        req: Request<pb::SetIdleRequest>,
    ) -> Result<Response<pb::SetIdleResponse>, Status> {
        let caller = caller_of(&req)?;
        let req = req.into_inner();
        let after = (req.after_ms > 0).then(|| std::time::Duration::from_millis(req.after_ms));
        self.engine.set_idle(&req.workload, after, caller)?;
        Ok(Response::new(pb::SetIdleResponse {}))
    }

    async fn set_periodic(
        &self,
        req: Request<pb::SetPeriodicRequest>,
    ) -> Result<Response<pb::SetPeriodicResponse>, Status> {
        let caller = caller_of(&req)?;
        let req = req.into_inner();
        let every = (req.every_ms > 0).then(|| std::time::Duration::from_millis(req.every_ms));
        self.engine.set_periodic(&req.workload, every, caller)?;
        Ok(Response::new(pb::SetPeriodicResponse {}))
    }

    async fn wake(&self, req: Request<pb::WakeRequest>) -> Result<Response<pb::RestoreRunning>, Status> {
        let caller = caller_of(&req)?;
        Ok(Response::new(self.engine.wake(&req.into_inner().workload, caller).await?.into()))
    }

    async fn set_spot(
        &self,
        req: Request<pb::SetSpotRequest>,
    ) -> Result<Response<pb::SetSpotResponse>, Status> {
        let caller = caller_of(&req)?;
        let req = req.into_inner();
        self.engine.set_spot(&req.workload, req.on, caller)?;
        Ok(Response::new(pb::SetSpotResponse {}))
    }

    async fn register_container(
        &self,
        req: Request<pb::RegisterContainerRequest>,
    ) -> Result<Response<pb::RegisterContainerResponse>, Status> {
        if caller_of(&req)? != Caller::Root {
            return Err(PolicyError::RootOnly("register containers").into());
        }
        let r = req.into_inner();
        let registration = Registration {
            container: ContainerRef {
                id: r.id,
                init_pid: r.init_pid,
                image: r.image,
                any_image: r.any_image,
                gpu_devices: r.gpu_devices,
                ..Default::default()
            },
            identity: Identity {
                namespace: r.namespace,
                owner_kind: r.owner_kind,
                owner_name: r.owner_name,
                ordinal: r.ordinal,
                container: r.container,
            },
            checkpoint_every: (r.checkpoint_every_ms > 0)
                .then(|| Duration::from_millis(r.checkpoint_every_ms)),
        };
        let workload = self.engine.register_container(registration)?;
        Ok(Response::new(pb::RegisterContainerResponse { workload }))
    }

    async fn forget_container(
        &self,
        req: Request<pb::ForgetContainerRequest>,
    ) -> Result<Response<pb::ForgetContainerResponse>, Status> {
        if caller_of(&req)? != Caller::Root {
            return Err(PolicyError::RootOnly("forget containers").into());
        }
        self.engine.forget_container(&req.into_inner().id);
        Ok(Response::new(pb::ForgetContainerResponse {}))
    }

    async fn evacuate(
        &self,
        req: Request<pb::EvacuateRequest>,
    ) -> Result<Response<pb::EvacuateResponse>, Status> {
        if caller_of(&req)? != Caller::Root {
            return Err(PolicyError::RootOnly("evacuate the node").into());
        }
        let req = req.into_inner();
        let within = std::time::Duration::from_millis(match req.within_ms {
            0 => DEFAULT_EVACUATE_WITHIN_MS,
            ms => ms,
        });
        let params = EvacuateParams {
            cause: Some(req.cause).filter(|c| !c.is_empty()).unwrap_or_else(|| "stasis evacuate".into()),
            deadline: std::time::SystemTime::now() + within,
            leave_running: req.leave_running,
        };
        let engine = self.engine.clone();
        // A job of its own: the evacuation goes on if the caller goes away.
        let done = tokio::spawn(async move { engine.evacuate(params).await })
            .await
            .map_err(|e| Status::internal(format!("the evacuation failed: {e}")))?;
        Ok(Response::new(pb::EvacuateResponse { workloads: done.into_iter().map(Into::into).collect() }))
    }
}

/// An evacuation's window when the caller names none: the shortest a cloud gives (GCP).
const DEFAULT_EVACUATE_WITHIN_MS: u64 = 30_000;
