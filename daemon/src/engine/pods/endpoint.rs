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
use tracing::{info, warn};

use super::super::{Engine, ProgressFn};
use super::restore::PodStart;
use crate::error_chain;

/// How long a starting container's init waits for the NRI plugin to register its container.
const REGISTRATION_WAIT: Duration = Duration::from_secs(20);

/// The longest request line accepted.
const MAX_REQUEST: u64 = 4096;

#[derive(Debug, Deserialize)]
struct Request {
    op: String,
    /// For an eviction: the time left before the kubelet stops the container, ms.
    within_ms: Option<u64>,
}

/// Serves the pod endpoint at `path` until the task is dropped.
pub async fn serve(engine: Arc<Engine>, path: &Path) -> std::io::Result<()> {
    if let Some(dir) = path.parent() {
        std::fs::create_dir_all(dir)?;
    }
    let _ = std::fs::remove_file(path);
    let listener = UnixListener::bind(path)?;
    // Any uid may connect: what a caller may do is decided by which container it is in.
    std::fs::set_permissions(path, std::fs::Permissions::from_mode(0o666))?;
    info!(socket = %path.display(), "pod endpoint listening");
    loop {
        let (stream, _) = listener.accept().await?;
        let engine = engine.clone();
        tokio::spawn(async move {
            if let Err(e) = handle(engine, stream).await {
                warn!(error = %e, "pod endpoint connection failed");
            }
        });
    }
}

async fn handle(engine: Arc<Engine>, stream: UnixStream) -> std::io::Result<()> {
    let caller = stream.peer_cred()?.pid();
    let (read, mut write) = stream.into_split();
    let mut line = String::new();
    BufReader::new(read.take(MAX_REQUEST)).read_line(&mut line).await?;
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
