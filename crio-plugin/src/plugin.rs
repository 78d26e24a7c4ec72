//! One NRI session: register with the runtime, answer its requests at once (it waits at most
//! 2 s, then drops the plugin), and pass what they say about opted-in containers on to
//! stasisd, which is told asynchronously.

use std::collections::HashMap;
use std::path::PathBuf;
use std::sync::Arc;

use prost::Message;
use stasis_proto::nri::{
    ConfigureResponse, Container, ContainerEvent, CreateContainerResponse, Event, PodSandbox,
    RegisterPluginRequest, StateChangeEvent, SynchronizeRequest, SynchronizeResponse,
};
use stasis_proto::stasis::v1::RegisterContainerRequest;
use stasis_proto::ttrpc::{Request, Response, Status};
use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio::net::UnixStream;
use tracing::{debug, info, warn};

use crate::inventory::{Injection, adjustment, opted_in, registration};
use crate::mux::{self, PLUGIN_CONN, RUNTIME_CONN};
use crate::ttrpc::{Frame, REQUEST, RESPONSE, TooLarge};

/// What the plugin tells stasisd (`stasisd.rs`; a recording fake in tests). Neither call may
/// block: the runtime is waiting.
pub trait Stasisd: Send + Sync {
    fn register(&self, container: RegisterContainerRequest);
    fn forget(&self, id: String);
}

#[derive(Debug, Clone)]
pub struct Settings {
    /// The runtime's NRI socket.
    pub socket: PathBuf,
    pub name: String,
    /// Where among the plugins it is called ("00" to "99").
    pub index: String,
    pub injection: Injection,
}

#[derive(Debug, thiserror::Error)]
pub enum SessionError {
    #[error("cannot reach the runtime's NRI socket {0}")]
    Connect(PathBuf, #[source] std::io::Error),
    #[error("the NRI connection failed")]
    Io(#[from] std::io::Error),
    #[error("the runtime closed the NRI connection")]
    Closed,
    #[error(transparent)]
    TooLarge(#[from] TooLarge),
    #[error("the runtime refused the registration: {0}")]
    Refused(String),
    #[error("the runtime sent a malformed {0}")]
    Malformed(&'static str, #[source] prost::DecodeError),
}

/// The events followed: bit 1 << (event - 1) each.
fn subscriptions() -> i32 {
    [Event::CreateContainer, Event::PostStartContainer, Event::StopContainer, Event::RemoveContainer]
        .iter()
        .map(|e| 1 << (*e as i32 - 1))
        .sum()
}

/// Registers with the runtime at `settings.socket` and serves it until it disconnects.
pub async fn run(settings: &Settings, stasisd: Arc<dyn Stasisd>) -> Result<(), SessionError> {
    let mut stream = UnixStream::connect(&settings.socket)
        .await
        .map_err(|e| SessionError::Connect(settings.socket.clone(), e))?;
    let register =
        RegisterPluginRequest { plugin_name: settings.name.clone(), plugin_idx: settings.index.clone() };
    let request = Request {
        service: "nri.pkg.api.v1alpha1.Runtime".into(),
        method: "RegisterPlugin".into(),
        payload: register.encode_to_vec(),
        timeout_nano: 0,
    };
    let frame = Frame { stream: 1, kind: REQUEST, payload: request.encode_to_vec() };
    stream.write_all(&mux::encode(RUNTIME_CONN, &frame.encode())).await?;
    let mut handler = Handler { settings: settings.clone(), stasisd, pods: HashMap::new() };
    let (mut incoming, mut conns) = (Vec::new(), HashMap::<u32, Vec<u8>>::new());
    let mut chunk = vec![0u8; 64 << 10];
    loop {
        let n = stream.read(&mut chunk).await?;
        if n == 0 {
            return Err(SessionError::Closed);
        }
        incoming.extend_from_slice(&chunk[..n]);
        while let Some((conn, data)) = mux::take(&mut incoming) {
            let buf = conns.entry(conn).or_default();
            buf.extend_from_slice(&data);
            while let Some(frame) = Frame::take(buf)? {
                match (conn, frame.kind) {
                    (PLUGIN_CONN, REQUEST) => {
                        let answer = handler.answer(&frame.payload);
                        let reply =
                            Frame { stream: frame.stream, kind: RESPONSE, payload: answer.encode_to_vec() };
                        stream.write_all(&mux::encode(PLUGIN_CONN, &reply.encode())).await?;
                    }
                    (RUNTIME_CONN, RESPONSE) => {
                        let response = Response::decode(frame.payload.as_slice())
                            .map_err(|e| SessionError::Malformed("registration answer", e))?;
                        match response.status.filter(|s| s.code != 0) {
                            Some(status) => return Err(SessionError::Refused(status.message)),
                            None => info!(name = %settings.name, "registered with the runtime"),
                        }
                    }
                    (conn, kind) => debug!(conn, kind, "ignored NRI message"),
                }
            }
        }
    }
}

/// Answers the runtime's requests.
struct Handler {
    settings: Settings,
    stasisd: Arc<dyn Stasisd>,
    /// The pods the runtime told of, by id (a container's own events carry its pod too).
    pods: HashMap<String, PodSandbox>,
}

impl Handler {
    fn answer(&mut self, request: &[u8]) -> Response {
        let ok =
            |payload: Vec<u8>| Response { status: Some(Status { code: 0, message: String::new() }), payload };
        let request = match Request::decode(request) {
            Ok(r) => r,
            Err(e) => {
                warn!(error = %e, "malformed NRI request");
                return Response {
                    status: Some(Status { code: 3, message: format!("malformed request: {e}") }),
                    payload: Vec::new(),
                };
            }
        };
        debug!(method = %request.method, "NRI request");
        let payload = request.payload.as_slice();
        match request.method.as_str() {
            "Configure" => ok(ConfigureResponse { events: subscriptions() }.encode_to_vec()),
            "Synchronize" => {
                let sync = SynchronizeRequest::decode(payload).unwrap_or_default();
                self.pods.extend(sync.pods.iter().map(|p| (p.id.clone(), p.clone())));
                for container in &sync.containers {
                    self.started(None, container);
                }
                ok(SynchronizeResponse { more: sync.more }.encode_to_vec())
            }
            "CreateContainer" => {
                let event = ContainerEvent::decode(payload).unwrap_or_default();
                ok(self.created(&event).encode_to_vec())
            }
            "PostStartContainer" | "StartContainer" => {
                let event = ContainerEvent::decode(payload).unwrap_or_default();
                if let Some(container) = &event.container {
                    self.started(event.pod.as_ref(), container);
                }
                ok(Vec::new())
            }
            "StopContainer" | "RemoveContainer" => {
                let event = ContainerEvent::decode(payload).unwrap_or_default();
                self.ended(&request.method, event.pod.as_ref(), event.container.as_ref());
                ok(Vec::new())
            }
            "StateChange" => {
                let change = StateChangeEvent::decode(payload).unwrap_or_default();
                match (Event::try_from(change.event), &change.container) {
                    (Ok(Event::PostStartContainer), Some(c)) => self.started(change.pod.as_ref(), c),
                    (Ok(Event::StopContainer), c) => {
                        self.ended("StopContainer", change.pod.as_ref(), c.as_ref())
                    }
                    (Ok(Event::RemoveContainer), c) => {
                        self.ended("RemoveContainer", change.pod.as_ref(), c.as_ref())
                    }
                    _ => {}
                }
                ok(Vec::new())
            }
            _ => ok(Vec::new()),
        }
    }

    fn pod_of<'a>(&'a self, given: Option<&'a PodSandbox>, container: &Container) -> Option<&'a PodSandbox> {
        given.or_else(|| self.pods.get(&container.pod_sandbox_id))
    }

    /// An opted-in container being created gets the bundle and the endpoint.
    fn created(&mut self, event: &ContainerEvent) -> CreateContainerResponse {
        if let Some(pod) = &event.pod {
            self.pods.insert(pod.id.clone(), pod.clone());
        }
        let chosen = event.pod.as_ref().filter(|p| opted_in(p));
        match (chosen, &event.container) {
            (Some(pod), Some(c)) => {
                info!(pod = %pod.name, namespace = %pod.namespace, container = %c.name, annotations = ?c.annotations, "injecting stasis");
                CreateContainerResponse { adjust: Some(adjustment(&self.settings.injection)) }
            }
            _ => CreateContainerResponse::default(),
        }
    }

    /// A started (or, at synchronization, running) container of an opted-in pod is
    /// registered with stasisd.
    fn started(&mut self, pod: Option<&PodSandbox>, container: &Container) {
        let Some(pod) = self.pod_of(pod, container).filter(|p| opted_in(p)) else { return };
        if container.pid == 0 {
            warn!(container = %container.id, "an opted-in container without a pid; not registered");
            return;
        }
        self.stasisd.register(registration(pod, container));
    }

    /// A stopped container of an opted-in pod that did not stop cleanly is reported; a
    /// removed one is forgotten.
    fn ended(&mut self, how: &str, pod: Option<&PodSandbox>, container: Option<&Container>) {
        let Some(container) = container else { return };
        let Some(pod) = self.pod_of(pod, container).filter(|p| opted_in(p)).cloned() else { return };
        match how {
            "StopContainer" if container.exit_code != 0 => warn!(
                pod = %pod.name, namespace = %pod.namespace, container = %container.name,
                exit_code = container.exit_code, reason = %container.status_reason,
                "an opted-in container stopped unplanned"
            ),
            "RemoveContainer" => self.stasisd.forget(container.id.clone()),
            _ => {}
        }
    }
}
