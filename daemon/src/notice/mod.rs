//! Preemption notices: watching the cloud's instance metadata service for the notice a spot
//! (preemptible) VM gets before it is taken away, and handing each notice to the engine,
//! which makes the opted-in workloads durable before the deadline (`engine/evacuate.rs`).
//!
//! ```text
//!  IMDS (AWS) ─┐                                   ┌─> evict every opted-in workload,
//!  GCP metadata ├─ watch(): poll, dedup, back off ─>│   shortest first, before the deadline
//!  Azure events ┘        Notice { deadline }       └─> done: Azure's event is acknowledged
//! ```
//!
//! One module per cloud knows its endpoints and response shapes; this one holds the loop
//! they share: poll every `poll`, and while the endpoint cannot be reached, say so once and
//! back off (never spin).

mod aws;
mod azure;
mod gcp;

use std::sync::Arc;
use std::time::{Duration, SystemTime};

use tokio::sync::{mpsc, oneshot};
use tracing::{debug, info, warn};

use crate::engine::{Engine, EvacuateParams};
pub use crate::linux::cloud::Cloud;

/// What a notice asks for.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum NoticeKind {
    /// The machine goes at the deadline: evict every opted-in workload before it.
    Preemption,
    /// The machine is at raised risk (AWS's rebalance recommendation): a checkpoint left
    /// running now makes a later eviction's delta small.
    Rebalance,
}

/// One notice from the cloud.
#[derive(Debug)]
pub struct Notice {
    pub cloud: Cloud,
    pub kind: NoticeKind,
    /// When the machine goes (wall clock); for a rebalance, when it was recommended.
    pub deadline: SystemTime,
    /// What the cloud said, for logs and status.
    pub detail: String,
    /// Told once the engine is done with the notice; Azure acknowledges its event then, so
    /// that the machine may go early.
    pub done: Option<oneshot::Sender<()>>,
}

/// How to watch.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct WatchSettings {
    pub cloud: Cloud,
    /// The metadata service (the cloud's own unless overridden, e.g. by a test's emulator).
    pub base_url: String,
    /// How often to ask.
    pub poll: Duration,
}

/// A metadata service could not be asked, or answered what it should not.
#[derive(Debug, thiserror::Error)]
pub enum NoticeError {
    #[error("request to {url} failed")]
    Request {
        url: String,
        #[source]
        source: reqwest::Error,
    },
    #[error("{url} answered {status}")]
    Status { url: String, status: reqwest::StatusCode },
    #[error("unexpected answer from {url}: {reason}")]
    Answer { url: String, reason: String },
}

/// The longest wait between tries at an unreachable metadata service: a notice may give 30 s
/// only, so the watcher never sleeps through much of it.
const MAX_BACKOFF: Duration = Duration::from_secs(5);
/// How long one request may take (GCP's waiting requests get their own wait on top).
const REQUEST_TIMEOUT: Duration = Duration::from_secs(5);

/// Watches for notices until `notices` is closed.
pub async fn watch(settings: WatchSettings, notices: mpsc::Sender<Notice>) {
    let base = settings.base_url.trim_end_matches('/').to_owned();
    let client = match reqwest::Client::builder().timeout(REQUEST_TIMEOUT + settings.poll).no_proxy().build()
    {
        Ok(client) => client,
        Err(e) => {
            warn!(error = %crate::error_chain(&e), "cannot make an HTTP client: preemption notices are not watched");
            return;
        }
    };
    let mut source = match settings.cloud {
        Cloud::Aws => Source::Aws(aws::Imds::new(client, base)),
        Cloud::Gcp => Source::Gcp(gcp::Metadata::new(client, base, settings.poll)),
        Cloud::Azure => Source::Azure(azure::ScheduledEvents::new(client, base)),
    };
    info!(cloud = settings.cloud.name(), url = %settings.base_url, poll_ms = settings.poll.as_millis() as u64, "watching for preemption notices");
    let mut backoff: Option<Duration> = None;
    loop {
        match source.poll().await {
            Ok(found) => {
                if backoff.take().is_some() {
                    info!(cloud = settings.cloud.name(), "the metadata service answers again");
                }
                for notice in found {
                    if notices.send(notice).await.is_err() {
                        return;
                    }
                }
            }
            Err(e) => {
                let error = crate::error_chain(&e);
                match backoff {
                    None => {
                        warn!(cloud = settings.cloud.name(), %error, "cannot read preemption notices; retrying with back-off")
                    }
                    Some(_) => {
                        debug!(cloud = settings.cloud.name(), %error, "metadata service still unreachable")
                    }
                }
                backoff = Some(backoff.map_or(settings.poll, |b| (b * 2).min(MAX_BACKOFF)));
            }
        }
        if notices.is_closed() {
            return;
        }
        tokio::time::sleep(backoff.unwrap_or(settings.poll)).await;
    }
}

/// Watches as `settings` say and has `engine` act on each notice, for as long as the engine
/// lives.
pub fn start(engine: &Arc<Engine>, settings: WatchSettings) {
    let (tx, mut rx) = mpsc::channel(8);
    tokio::spawn(watch(settings, tx));
    let engine = Arc::downgrade(engine);
    tokio::spawn(async move {
        while let Some(notice) = rx.recv().await {
            let Some(engine) = engine.upgrade() else { return };
            // Each on its own: a preemption must not wait for a rebalance's checkpoints.
            tokio::spawn(act(engine, notice));
        }
    });
}

/// Evacuates for `notice`: evictions for a preemption, checkpoints left running for a
/// rebalance recommendation; then says it is done.
async fn act(engine: Arc<Engine>, notice: Notice) {
    let left_ms = notice.deadline.duration_since(SystemTime::now()).map_or(0, |d| d.as_millis() as u64);
    warn!(cloud = notice.cloud.name(), kind = ?notice.kind, detail = %notice.detail, left_ms, "notice from the cloud");
    let params = EvacuateParams {
        cause: format!("{}: {}", notice.cloud.name(), notice.detail),
        deadline: notice.deadline,
        leave_running: notice.kind == NoticeKind::Rebalance,
    };
    let results = engine.evacuate(params).await;
    let durable = results.iter().filter(|e| e.checkpoint.is_some()).count();
    info!(durable, of = results.len(), "done with the notice");
    if let Some(done) = notice.done {
        let _ = done.send(());
    }
}

/// The cloud being watched.
enum Source {
    Aws(aws::Imds),
    Gcp(gcp::Metadata),
    Azure(azure::ScheduledEvents),
}

impl Source {
    /// Asks once; answers the notices not seen before.
    async fn poll(&mut self) -> Result<Vec<Notice>, NoticeError> {
        match self {
            Self::Aws(s) => s.poll().await,
            Self::Gcp(s) => s.poll().await,
            Self::Azure(s) => s.poll().await,
        }
    }
}

/// An answer of a metadata service.
struct Answer {
    status: reqwest::StatusCode,
    /// Its `ETag` header, if any (GCP's, to wait for a change from).
    etag: Option<String>,
    body: String,
}

/// Sends `request` (to `url`) and reads the answer.
async fn send(request: reqwest::RequestBuilder, url: &str) -> Result<Answer, NoticeError> {
    let err = |source| NoticeError::Request { url: url.to_owned(), source };
    let response = request.send().await.map_err(err)?;
    let status = response.status();
    let etag = response.headers().get("etag").and_then(|v| v.to_str().ok()).map(str::to_owned);
    Ok(Answer { status, etag, body: response.text().await.map_err(err)? })
}

/// `status`, unless it is neither success nor `allowed`.
fn expect(
    status: reqwest::StatusCode,
    url: &str,
    allowed: &[u16],
) -> Result<reqwest::StatusCode, NoticeError> {
    match status.is_success() || allowed.contains(&status.as_u16()) {
        true => Ok(status),
        false => Err(NoticeError::Status { url: url.to_owned(), status }),
    }
}

/// Parses an RFC 3339 time (`2026-11-23T15:00:00Z`).
fn rfc3339(text: &str) -> Option<SystemTime> {
    text.trim().parse::<jiff::Timestamp>().ok().map(SystemTime::from)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn rfc3339_times_parse() {
        let t = rfc3339("2026-11-23T15:00:10Z").unwrap();
        let secs = t.duration_since(SystemTime::UNIX_EPOCH).unwrap().as_secs();
        assert_eq!(secs, 1_795_446_010);
        assert!(rfc3339("soon").is_none());
    }
}
