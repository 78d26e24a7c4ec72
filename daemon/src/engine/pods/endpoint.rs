//! The pod endpoint: the socket opted-in containers reach (mounted into them), which is not
//! stasisd's API. A caller is known by its process (`SO_PEERCRED`), whose pid namespace names
//! its container; it may only ask for its own container's start and eviction, whatever uid it
//! runs as. Nothing else is served here.
//!
//! One request per connection, one JSON line each way:
//! - `{"op":"start"}` (from stasis-pod as the container starts): `{"action":"fresh","why":..}`
//!   or `{"action":"restored","checkpoint":..,"pid":..}` once the tree runs;
//! - `{"op":"evict","within_ms":..}` (from the preStop hook, with the time left before the
//!   kubelet stops the container): `{"checkpoint":..}` once it is durable and the tree is gone;
//!   refused at once when the checkpoint is not expected to be durable in that time;
//! - `{"op":"ended"}` (from stasis-pod once its workload is gone): `{"evicted":..}`, whether
//!   it was evicted (the pod is going away), once an eviction under way has ended;
//! - `{"op":"ready"}` (from the container's startup probe): `{"ready":..}`, whether its tree
//!   runs (started afresh, or restored and handed to the init);
//! - any failure: `{"error":..}`; an eviction that fails leaves the tree running.

use std::os::unix::fs::PermissionsExt;
use std::path::Path;
use std::sync::Arc;
use std::time::Duration;

use serde::Deserialize;
use serde_json::{Value, json};
use tokio::io::{AsyncBufReadExt, AsyncReadExt, AsyncWriteExt, BufReader};
use tokio::net::{UnixListener, UnixStream};
use tracing::{debug, info, warn};

use super::super::{Engine, ProgressFn};
use super::restore::PodStart;
use crate::admission::Admission;
use crate::error_chain;

/// How long a starting container's init waits for the NRI plugin to register its container.
const REGISTRATION_WAIT: Duration = Duration::from_secs(20);

/// The longest request line accepted.
const MAX_REQUEST: u64 = 4096;

/// Connections served at once, and from one uid: any local user may connect, and must not
/// take every place (a container's own calls come from its uids).
const MAX_CONNECTIONS: usize = 256;
const MAX_PER_UID: usize = 16;

/// How long a connection has to send its request.
const REQUEST_WAIT: Duration = Duration::from_secs(10);

#[derive(Debug, Deserialize)]
struct Request {
    op: String,
    /// For an eviction: the time left before the kubelet stops the container, ms.
    within_ms: Option<u64>,
}

/// Serves the pod endpoint at `path` until the task is dropped.
pub async fn serve(engine: Arc<Engine>, path: &Path) -> std::io::Result<()> {
    serve_with(engine, path, Admission::new(MAX_CONNECTIONS, MAX_PER_UID), REQUEST_WAIT).await
}

/// [`serve`] with its limits given. It never stops serving once listening: a failed accept
/// is waited out, a connection beyond its uid's share is closed at once, and one that sends
/// no request within `request_wait` is dropped.
async fn serve_with(
    engine: Arc<Engine>,
    path: &Path,
    admission: Admission,
    request_wait: Duration,
) -> std::io::Result<()> {
    if let Some(dir) = path.parent() {
        std::fs::create_dir_all(dir)?;
    }
    let _ = std::fs::remove_file(path);
    let listener = UnixListener::bind(path)?;
    // Any uid may connect: what a caller may do is decided by which container it is in.
    std::fs::set_permissions(path, std::fs::Permissions::from_mode(0o666))?;
    info!(socket = %path.display(), "pod endpoint listening");
    let mut failures = 0;
    loop {
        let slot = admission.slot().await;
        let stream = match listener.accept().await {
            Ok((stream, _)) => stream,
            Err(e) => {
                crate::admission::accept_failed("pod endpoint", &e, &mut failures).await;
                continue;
            }
        };
        failures = 0;
        let uid = stream.peer_cred().ok().map(|c| c.uid());
        let Some(admitted) = admission.admit(slot, uid) else {
            debug!(uid, "pod endpoint: that uid has its share of connections; closing one more");
            continue;
        };
        let engine = engine.clone();
        tokio::spawn(async move {
            let _admitted = admitted;
            if let Err(e) = handle(engine, stream, request_wait).await {
                warn!(error = %e, "pod endpoint connection failed");
            }
        });
    }
}

async fn handle(engine: Arc<Engine>, stream: UnixStream, request_wait: Duration) -> std::io::Result<()> {
    let caller = stream.peer_cred()?.pid();
    let (read, mut write) = stream.into_split();
    let mut line = String::new();
    let mut reader = BufReader::new(read.take(MAX_REQUEST));
    tokio::time::timeout(request_wait, reader.read_line(&mut line))
        .await
        .map_err(|_| std::io::Error::new(std::io::ErrorKind::TimedOut, "no request in time"))??;
    let answer = match (serde_json::from_str::<Request>(&line), caller) {
        (Err(e), _) => json!({ "error": format!("malformed request: {e}") }),
        (Ok(_), None) => json!({ "error": "the caller's process is not visible to stasisd" }),
        (Ok(request), Some(pid)) => answer(&engine, &request, pid).await,
    };
    write.write_all(format!("{answer}\n").as_bytes()).await
}

async fn answer(engine: &Arc<Engine>, request: &Request, caller: i32) -> Value {
    let op = request.op.as_str();
    let wait = if op == "start" { REGISTRATION_WAIT } else { Duration::ZERO };
    let Some(w) = registered(engine, caller, wait).await else {
        return json!({ "error": super::PodError::UnknownCaller.to_string() });
    };
    let Some(c) = w.container.clone() else { return json!({ "error": "no container" }) };
    let quiet: ProgressFn = Arc::new(|_| {});
    info!(workload = %w.name, container = %c.id, caller, op, "pod request");
    match op {
        "start" => match engine.start_container(&w.name, &c, quiet).await {
            Ok(PodStart::Fresh { why }) => json!({ "action": "fresh", "why": why }),
            Ok(PodStart::Restored { checkpoint, pid }) => {
                json!({ "action": "restored", "checkpoint": checkpoint, "pid": pid })
            }
            Err(e) => json!({ "error": error_chain(&e) }),
        },
        "evict" => match engine.evict_container(w, request.within_ms.map(Duration::from_millis), quiet).await
        {
            Ok(outcome) => json!({ "checkpoint": outcome.id, "durable": outcome.durable }),
            Err(e) => json!({ "error": error_chain(&e) }),
        },
        "ended" => json!({ "evicted": evicted(engine, &w.name).await }),
        "ready" => json!({ "ready": engine.tree_runs(&w) }),
        other => json!({ "error": format!("unknown request {other:?} (start, evict, ended, ready)") }),
    }
}

/// The workload of the container `caller` runs in, waiting up to `wait` for it to be
/// registered.
async fn registered(engine: &Engine, caller: i32, wait: Duration) -> Option<super::super::Workload> {
    let deadline = tokio::time::Instant::now() + wait;
    loop {
        if let Some(w) = engine.container_of(caller) {
            return Some(w);
        }
        if tokio::time::Instant::now() >= deadline {
            return None;
        }
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
}

/// Whether container workload `name` was evicted, once an eviction under way is over (its
/// tree is killed just before the eviction's end).
async fn evicted(engine: &Engine, name: &str) -> bool {
    loop {
        match engine.registry.get(name).and_then(|w| w.container) {
            Some(c) if c.evicting => tokio::time::sleep(Duration::from_millis(50)).await,
            Some(c) => return c.evicted,
            None => return false,
        }
    }
}

#[cfg(test)]
mod tests {
    use tokio::io::AsyncReadExt;

    use super::*;
    use crate::criu::fake::FakeCriu;
    use crate::cuda::fake::FakeGpu;
    use crate::engine::rollback_tests::rig;

    /// What the endpoint answers on a fresh connection to `path` that sends `request`.
    async fn ask(path: &Path, request: &str) -> String {
        let mut conn = UnixStream::connect(path).await.unwrap();
        // A connection closed at once may refuse the write; the answer says what happened.
        let _ = conn.write_all(request.as_bytes()).await;
        let mut answer = String::new();
        let _ = tokio::time::timeout(Duration::from_secs(5), conn.read_to_string(&mut answer)).await;
        answer
    }

    #[tokio::test]
    async fn idle_connections_take_their_share_only_and_not_for_long() {
        let r = rig(FakeCriu::default(), FakeGpu::default());
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("pod.sock");
        let (engine, at) = (r.engine.clone(), path.clone());
        let server = tokio::spawn(async move {
            serve_with(engine, &at, Admission::new(64, 2), Duration::from_millis(500)).await
        });
        for _ in 0..50 {
            if path.exists() {
                break;
            }
            tokio::time::sleep(Duration::from_millis(20)).await;
        }
        let answered = ask(&path, "{\"op\":\"ready\"}\n").await;
        assert!(answered.contains("error"), "a request is answered: {answered:?}");
        // Two connections that send nothing hold this uid's share: a third is closed unanswered.
        let idle = [UnixStream::connect(&path).await.unwrap(), UnixStream::connect(&path).await.unwrap()];
        tokio::time::sleep(Duration::from_millis(100)).await;
        assert_eq!(ask(&path, "{\"op\":\"ready\"}\n").await, "", "a third connection of the uid");
        // They are dropped once their time to send a request is over; then it is served again.
        tokio::time::sleep(Duration::from_millis(700)).await;
        let answered = ask(&path, "{\"op\":\"ready\"}\n").await;
        assert!(answered.contains("error"), "served again: {answered:?}");
        drop(idle);
        assert!(!server.is_finished(), "the endpoint serves on");
        server.abort();
    }
}
