//! Prometheus metrics of stasisd (opt-in, `--metrics-listen ADDR`): checkpoints and restores
//! by result, their timings, bytes uploaded and deduplicated, store errors, GPU phase time,
//! idle reclaims and wakes. Served as text on `GET /metrics` over HTTP/1 (hyper).

use std::convert::Infallible;
use std::net::SocketAddr;
use std::sync::Arc;

use bytes::Bytes;
use http_body_util::Full;
use hyper::body::Incoming;
use hyper::{Method, Request, Response, StatusCode};
use hyper_util::rt::{TokioIo, TokioTimer};
use prometheus_client::encoding::text::encode;
use prometheus_client::metrics::counter::Counter;
use prometheus_client::metrics::family::Family;
use prometheus_client::metrics::histogram::{Histogram, exponential_buckets};
use prometheus_client::registry::Registry;
use tokio::net::TcpListener;
use tracing::{debug, info};

type Results = Family<Vec<(String, String)>, Counter>;

/// The metrics; cheap to update from any thread.
pub struct Metrics {
    registry: Registry,
    checkpoints: Results,
    restores: Results,
    frozen: Histogram,
    durable: Histogram,
    first_run: Histogram,
    resident: Histogram,
    gpu: Histogram,
    bytes_uploaded: Counter,
    bytes_deduplicated: Counter,
    store_errors: Counter,
    reclaims: Results,
}

/// Seconds, from 10 ms to about 20 minutes.
fn seconds() -> Histogram {
    Histogram::new(exponential_buckets(0.01, 2.0, 18))
}

impl Default for Metrics {
    fn default() -> Self {
        let mut m = Metrics {
            registry: Registry::with_prefix("stasis"),
            checkpoints: Results::default(),
            restores: Results::default(),
            frozen: seconds(),
            durable: seconds(),
            first_run: seconds(),
            resident: seconds(),
            gpu: seconds(),
            bytes_uploaded: Counter::default(),
            bytes_deduplicated: Counter::default(),
            store_errors: Counter::default(),
            reclaims: Results::default(),
        };
        m.registry.register("checkpoints", "Checkpoints, by result", m.checkpoints.clone());
        m.registry.register("restores", "Restores, by result", m.restores.clone());
        m.registry.register("frozen_seconds", "How long a checkpoint kept its tree frozen", m.frozen.clone());
        m.registry.register("durable_seconds", "From checkpoint request until durable", m.durable.clone());
        m.registry.register(
            "restore_first_run_seconds",
            "From restore request until the tree runs",
            m.first_run.clone(),
        );
        m.registry.register(
            "restore_resident_seconds",
            "From restore request until all memory is in",
            m.resident.clone(),
        );
        m.registry.register(
            "gpu_phase_seconds",
            "GPU lock, checkpoint and restore time of a checkpoint",
            m.gpu.clone(),
        );
        m.registry.register("uploaded_bytes", "Bytes written to the store", m.bytes_uploaded.clone());
        m.registry.register(
            "deduplicated_bytes",
            "Bytes of checkpoints the store already held",
            m.bytes_deduplicated.clone(),
        );
        m.registry.register(
            "store_errors",
            "Checkpoints and restores that failed on the store",
            m.store_errors.clone(),
        );
        m.registry.register("idle_reclaims", "Idle reclaims and wakes, by outcome", m.reclaims.clone());
        m
    }
}

fn result(label: &str) -> Vec<(String, String)> {
    vec![("result".into(), label.into())]
}

/// What a checkpoint that became durable measured.
#[derive(Debug, Clone, Copy, Default)]
pub struct CheckpointSample {
    pub frozen_ms: u64,
    pub durable_ms: u64,
    /// GPU lock, checkpoint and restore together (0: no GPU phase).
    pub gpu_ms: u64,
    pub bytes_total: u64,
    pub bytes_uploaded: u64,
}

/// What a restore that ended with its tree running measured.
#[derive(Debug, Clone, Copy, Default)]
pub struct RestoreSample {
    pub first_run_ms: u64,
    pub resident_ms: u64,
}

/// A failed job, as the metrics count it.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Failure {
    /// The store failed it.
    Store,
    Other,
}

impl Metrics {
    pub fn checkpoint_done(&self, done: Result<CheckpointSample, Failure>) {
        match done {
            Ok(s) => {
                self.checkpoints.get_or_create(&result("ok")).inc();
                self.frozen.observe(s.frozen_ms as f64 / 1e3);
                self.durable.observe(s.durable_ms as f64 / 1e3);
                if s.gpu_ms > 0 {
                    self.gpu.observe(s.gpu_ms as f64 / 1e3);
                }
                self.bytes_uploaded.inc_by(s.bytes_uploaded);
                self.bytes_deduplicated.inc_by(s.bytes_total.saturating_sub(s.bytes_uploaded));
            }
            Err(failure) => self.failed(&self.checkpoints, failure),
        }
    }

    pub fn restore_done(&self, done: Result<RestoreSample, Failure>) {
        match done {
            Ok(s) => {
                self.restores.get_or_create(&result("ok")).inc();
                self.first_run.observe(s.first_run_ms as f64 / 1e3);
                self.resident.observe(s.resident_ms as f64 / 1e3);
            }
            Err(failure) => self.failed(&self.restores, failure),
        }
    }

    fn failed(&self, jobs: &Results, failure: Failure) {
        jobs.get_or_create(&result("failed")).inc();
        if failure == Failure::Store {
            self.store_errors.inc();
        }
    }

    /// An idle reclaim or wake ended: `outcome` is "reclaimed", "used" (given back), "failed",
    /// "woken" or "wake_failed".
    pub fn reclaim(&self, outcome: &str) {
        self.reclaims.get_or_create(&result(outcome)).inc();
    }

    /// The metrics in Prometheus' text format.
    pub fn render(&self) -> String {
        let mut out = String::new();
        // Writing into a String cannot fail.
        let _ = encode(&mut out, &self.registry);
        out
    }
}

/// Connections the metrics server serves at once.
const MAX_CONNECTIONS: usize = 32;

/// Serves `GET /metrics` on `addr` for as long as the daemon runs.
pub async fn serve(addr: SocketAddr, metrics: Arc<Metrics>) -> std::io::Result<()> {
    let listener = TcpListener::bind(addr).await?;
    info!(address = %listener.local_addr()?, "serving metrics on /metrics");
    // A scraper's connections at once are few; more wait in the listen queue.
    let admission = crate::admission::Admission::new(MAX_CONNECTIONS, MAX_CONNECTIONS);
    tokio::spawn(async move {
        let mut failures = 0;
        loop {
            let slot = admission.slot().await;
            let conn = match listener.accept().await {
                Ok((conn, _)) => conn,
                Err(e) => {
                    crate::admission::accept_failed("metrics", &e, &mut failures).await;
                    continue;
                }
            };
            failures = 0;
            let admitted = admission.admit(slot, None);
            let metrics = metrics.clone();
            tokio::spawn(async move {
                let _admitted = admitted;
                let service = hyper::service::service_fn(move |request| answer(request, metrics.clone()));
                let served = hyper::server::conn::http1::Builder::new()
                    .timer(TokioTimer::new())
                    .header_read_timeout(HEAD_TIMEOUT)
                    .keep_alive(false)
                    .serve_connection(TokioIo::new(conn), service)
                    .await;
                if let Err(e) = served {
                    debug!(error = %e, "metrics connection failed");
                }
            });
        }
    });
    Ok(())
}

/// How long a connection may take to send its request's head.
const HEAD_TIMEOUT: std::time::Duration = std::time::Duration::from_secs(5);

/// The answer to one request: the metrics for `GET /metrics`, 404 for anything else.
async fn answer(
    request: Request<Incoming>,
    metrics: Arc<Metrics>,
) -> Result<Response<Full<Bytes>>, Infallible> {
    let (status, body) = match (request.method(), request.uri().path()) {
        (&Method::GET, "/metrics") => (StatusCode::OK, metrics.render()),
        _ => (StatusCode::NOT_FOUND, "only GET /metrics is served here\n".to_string()),
    };
    let mut response = Response::new(Full::new(Bytes::from(body)));
    *response.status_mut() = status;
    response.headers_mut().insert(
        hyper::header::CONTENT_TYPE,
        hyper::header::HeaderValue::from_static("text/plain; version=0.0.4"),
    );
    Ok(response)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn outcomes_are_counted_and_timed() {
        let m = Metrics::default();
        let ok = CheckpointSample {
            frozen_ms: 120,
            durable_ms: 900,
            bytes_total: 1000,
            bytes_uploaded: 300,
            gpu_ms: 0,
        };
        m.checkpoint_done(Ok(ok));
        m.checkpoint_done(Err(Failure::Other));
        m.restore_done(Err(Failure::Store));
        m.reclaim("woken");
        let text = m.render();
        for line in [
            "stasis_checkpoints_total{result=\"ok\"} 1",
            "stasis_checkpoints_total{result=\"failed\"} 1",
            "stasis_frozen_seconds_count 1",
            "stasis_uploaded_bytes_total 300",
            "stasis_deduplicated_bytes_total 700",
            "stasis_idle_reclaims_total{result=\"woken\"} 1",
            "stasis_restores_total{result=\"failed\"} 1",
            "stasis_store_errors_total 1",
        ] {
            assert!(text.lines().any(|l| l == line), "{line:?} missing from:\n{text}");
        }
    }
}
