//! A cloud metadata service on loopback, for stasisd's preemption-notice watchers: the
//! requests and answers of AWS's IMDSv2 (session token, `spot/instance-action`, rebalance
//! recommendation), GCP's metadata server (`instance/preempted` with `wait_for_change`,
//! `maintenance-event`) and Azure's Scheduled Events (with `StartRequests` acknowledgements),
//! each refusing requests without the headers the real one insists on. A test preempts the
//! machine, or makes the service hang, and reads what the watcher acknowledged.

use std::collections::HashMap;
use std::io::{BufReader, Write};
use std::net::{TcpListener, TcpStream};
use std::sync::{Arc, Condvar, Mutex};
use std::time::{Duration, SystemTime};

use crate::http::{read_body, read_head, serve_each};

/// Which cloud's service to play.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Cloud {
    Aws,
    Gcp,
    Azure,
}

impl Cloud {
    /// The name stasisd's `--notices` takes.
    pub fn flag(self) -> &'static str {
        match self {
            Self::Aws => "aws",
            Self::Gcp => "gcp",
            Self::Azure => "azure",
        }
    }
}

/// The VM name Azure's service reports for this machine.
pub const AZURE_VM: &str = "stasis-test-vm";
const AWS_TOKEN: &str = "AQAEAtoken-for-tests";

#[derive(Debug, Default)]
struct State {
    /// AWS: the instance-action and rebalance documents; GCP: preempted; Azure: the events.
    action: Option<String>,
    rebalance: Option<String>,
    preempted: bool,
    /// Bumped on every change: GCP's ETag.
    version: u64,
    events: Vec<String>,
    /// Event ids Azure was told to start.
    acknowledged: Vec<String>,
    hang: bool,
    requests: u64,
}

/// The service; stasisd gets `url()` as `--notice-url`.
pub struct Imds {
    pub cloud: Cloud,
    port: u16,
    state: Arc<(Mutex<State>, Condvar)>,
}

impl Imds {
    pub fn start(cloud: Cloud) -> Imds {
        let listener = TcpListener::bind("127.0.0.1:0").expect("a loopback port for the metadata service");
        let port = listener.local_addr().expect("its address").port();
        let state: Arc<(Mutex<State>, Condvar)> = Arc::default();
        let shared = state.clone();
        serve_each(listener, move |client| serve(client, cloud, &shared));
        Imds { cloud, port, state }
    }

    pub fn url(&self) -> String {
        format!("http://127.0.0.1:{}", self.port)
    }

    /// stasisd's flags for watching this service, asking every `poll_ms`.
    pub fn daemon_args(&self, poll_ms: u64) -> Vec<String> {
        [
            "--notices",
            self.cloud.flag(),
            "--notice-url",
            &self.url(),
            "--notice-poll-ms",
            &poll_ms.to_string(),
        ]
        .map(str::to_owned)
        .to_vec()
    }

    /// The machine goes at `deadline` (Azure: the event names `vm`).
    pub fn preempt(&self, deadline: SystemTime, vm: &str) {
        self.change(|s| match self.cloud {
            Cloud::Aws => s.action = Some(format!(r#"{{"action": "terminate", "time": "{}"}}"#, rfc3339(deadline))),
            Cloud::Gcp => s.preempted = true,
            Cloud::Azure => {
                let id = format!("event-{}", s.events.len() + 1);
                s.events.push(format!(
                    r#"{{"EventId": "{id}", "EventStatus": "Scheduled", "EventType": "Preempt", "ResourceType": "VirtualMachine", "Resources": ["{vm}"], "NotBefore": "{}", "Description": "", "EventSource": "Platform", "DurationInSeconds": -1}}"#,
                    rfc1123(deadline)
                ))
            }
        });
    }

    /// AWS: a rebalance recommendation.
    pub fn recommend_rebalance(&self) {
        self.change(|s| s.rebalance = Some(format!(r#"{{"noticeTime": "{}"}}"#, rfc3339(SystemTime::now()))));
    }

    /// Every request hangs (never answered) while `hang` is set.
    pub fn hang(&self, hang: bool) {
        self.change(|s| s.hang = hang);
    }

    /// Event ids acknowledged with `StartRequests` (Azure).
    pub fn acknowledged(&self) -> Vec<String> {
        self.state.0.lock().unwrap().acknowledged.clone()
    }

    /// Requests answered or held so far.
    pub fn requests(&self) -> u64 {
        self.state.0.lock().unwrap().requests
    }

    fn change(&self, f: impl FnOnce(&mut State)) {
        let mut s = self.state.0.lock().unwrap();
        f(&mut s);
        s.version += 1;
        self.state.1.notify_all();
    }
}

struct Request {
    method: String,
    path: String,
    query: HashMap<String, String>,
    headers: HashMap<String, String>,
    body: String,
}

fn serve(stream: TcpStream, cloud: Cloud, state: &(Mutex<State>, Condvar)) -> std::io::Result<()> {
    let mut reader = BufReader::new(stream.try_clone()?);
    let Some((_, lines)) = read_head(&mut reader)? else { return Ok(()) };
    let body = read_body(&mut reader, &lines, false)?;
    let mut parts = lines[0].split_whitespace();
    let (method, target) = (parts.next().unwrap_or_default().to_owned(), parts.next().unwrap_or_default());
    let (path, query) = target.split_once('?').unwrap_or((target, ""));
    let query =
        query.split('&').filter_map(|kv| kv.split_once('=')).map(|(k, v)| (k.into(), v.into())).collect();
    let headers = lines[1..]
        .iter()
        .filter_map(|l| l.split_once(':'))
        .map(|(k, v)| (k.trim().to_ascii_lowercase(), v.trim().to_owned()))
        .collect();
    let request = Request {
        method,
        path: path.to_owned(),
        query,
        headers,
        body: String::from_utf8_lossy(&body).into(),
    };
    let mut s = state.0.lock().unwrap();
    s.requests += 1;
    while s.hang {
        s = state.1.wait(s).unwrap();
    }
    let (status, extra, body) = match cloud {
        Cloud::Aws => aws(&request, &s),
        Cloud::Gcp => {
            let (status, body, etag) = gcp(&request, s, &state.1);
            (status, format!("ETag: {etag}\r\nMetadata-Flavor: Google\r\n"), body)
        }
        Cloud::Azure => azure(&request, &mut s),
    };
    let reason = if status == 200 { "OK" } else { "Error" };
    let mut out = stream;
    write!(
        out,
        "HTTP/1.1 {status} {reason}\r\nContent-Length: {}\r\nConnection: close\r\n{extra}\r\n{body}",
        body.len()
    )?;
    out.flush()
}

fn aws(r: &Request, s: &State) -> (u16, String, String) {
    let ok = |body: &str| (200, String::new(), body.to_owned());
    if r.method == "PUT" && r.path == "/latest/api/token" {
        return match r.headers.get("x-aws-ec2-metadata-token-ttl-seconds") {
            Some(ttl) => (200, format!("X-aws-ec2-metadata-token-ttl-seconds: {ttl}\r\n"), AWS_TOKEN.into()),
            None => (400, String::new(), "missing TTL".into()),
        };
    }
    if r.headers.get("x-aws-ec2-metadata-token").map(String::as_str) != Some(AWS_TOKEN) {
        return (401, String::new(), String::new());
    }
    let found = match r.path.as_str() {
        "/latest/meta-data/spot/instance-action" => s.action.as_deref(),
        "/latest/meta-data/events/recommendations/rebalance" => s.rebalance.as_deref(),
        _ => None,
    };
    found.map_or((404, String::new(), "Not Found".into()), ok)
}

fn gcp<'a>(r: &Request, mut s: std::sync::MutexGuard<'a, State>, changed: &Condvar) -> (u16, String, u64) {
    if r.headers.get("metadata-flavor").map(String::as_str) != Some("Google") {
        return (403, "missing Metadata-Flavor: Google".into(), s.version);
    }
    match r.path.as_str() {
        "/computeMetadata/v1/instance/preempted" => {
            if r.query.get("wait_for_change").map(String::as_str) == Some("true") {
                let last: u64 = r.query.get("last_etag").and_then(|e| e.parse().ok()).unwrap_or(u64::MAX);
                let wait = r.query.get("timeout_sec").and_then(|t| t.parse().ok()).unwrap_or(60);
                let (guard, _) =
                    changed.wait_timeout_while(s, Duration::from_secs(wait), |s| s.version == last).unwrap();
                s = guard;
            }
            let value = if s.preempted { "TRUE" } else { "FALSE" };
            (200, value.into(), s.version)
        }
        "/computeMetadata/v1/instance/maintenance-event" => (200, "NONE".into(), s.version),
        _ => (404, "Not Found".into(), s.version),
    }
}

fn azure(r: &Request, s: &mut State) -> (u16, String, String) {
    if r.headers.get("metadata").map(String::as_str) != Some("true") {
        return (400, String::new(), "missing Metadata: true".into());
    }
    match (r.method.as_str(), r.path.as_str()) {
        ("GET", "/metadata/instance/compute/name") => (200, String::new(), AZURE_VM.into()),
        ("GET", "/metadata/scheduledevents") => {
            let body =
                format!(r#"{{"DocumentIncarnation": {}, "Events": [{}]}}"#, s.version, s.events.join(","));
            (200, String::new(), body)
        }
        ("POST", "/metadata/scheduledevents") => {
            let started: serde_json::Value = serde_json::from_str(&r.body).unwrap_or_default();
            let ids = started["StartRequests"].as_array().cloned().unwrap_or_default();
            s.acknowledged.extend(ids.iter().filter_map(|e| Some(e["EventId"].as_str()?.to_owned())));
            (200, String::new(), String::new())
        }
        _ => (404, String::new(), "Not Found".into()),
    }
}

fn rfc3339(t: SystemTime) -> String {
    jiff::Timestamp::try_from(t).expect("a time jiff can hold").strftime("%Y-%m-%dT%H:%M:%SZ").to_string()
}

fn rfc1123(t: SystemTime) -> String {
    jiff::Timestamp::try_from(t)
        .expect("a time jiff can hold")
        .strftime("%a, %d %b %Y %H:%M:%S GMT")
        .to_string()
}

#[cfg(test)]
mod tests {
    use std::time::UNIX_EPOCH;

    use super::*;

    #[test]
    fn dates_are_written_as_the_clouds_write_them() {
        let t = UNIX_EPOCH + Duration::from_secs(1_795_446_010);
        assert_eq!(rfc3339(t), "2026-11-23T15:00:10Z");
        assert_eq!(rfc1123(t), "Mon, 23 Nov 2026 15:00:10 GMT");
    }
}
