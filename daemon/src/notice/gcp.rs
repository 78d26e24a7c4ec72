//! GCP: the metadata server (every request says `Metadata-Flavor: Google`).
//! `instance/preempted` turns `TRUE` when a spot VM is being preempted (30 s before it stops);
//! it is asked with `wait_for_change`, so the answer comes the moment it changes.
//! `instance/maintenance-event` turns `TERMINATE_ON_HOST_MAINTENANCE` 60 s before a
//! maintenance stop.

use std::time::{Duration, SystemTime};

use tracing::warn;

use super::{Answer, Cloud, Notice, NoticeError, NoticeKind, expect, send};

const PREEMPTED_PATH: &str = "/computeMetadata/v1/instance/preempted";
const MAINTENANCE_PATH: &str = "/computeMetadata/v1/instance/maintenance-event";
const FLAVOR: (&str, &str) = ("Metadata-Flavor", "Google");
/// What GCP gives a preempted VM, and a VM stopped for host maintenance.
const PREEMPTION_WINDOW: Duration = Duration::from_secs(30);
const MAINTENANCE_WINDOW: Duration = Duration::from_secs(60);

pub struct Metadata {
    client: reqwest::Client,
    base: String,
    /// How long the server may hold a waiting request.
    wait: Duration,
    /// The `preempted` value's ETag: the next request waits for it to change.
    etag: Option<String>,
    preempted: bool,
    maintenance: String,
}

impl Metadata {
    pub fn new(client: reqwest::Client, base: String, wait: Duration) -> Self {
        Self { client, base, wait, etag: None, preempted: false, maintenance: "NONE".into() }
    }

    pub async fn poll(&mut self) -> Result<Vec<Notice>, NoticeError> {
        let mut found = Vec::new();
        let preempted = self.preempted_now().await?;
        if preempted && !self.preempted {
            found.push(notice(NoticeKind::Preemption, PREEMPTION_WINDOW, "instance preempted".into()));
        }
        self.preempted = preempted;
        let url = format!("{}{MAINTENANCE_PATH}", self.base);
        let asked =
            self.get(&url).await.and_then(|answer| expect(answer.status, &url, &[]).map(|_| answer.body));
        let event = match asked {
            Ok(event) => event.trim().to_owned(),
            // The preemption found above must not be lost with this answer.
            Err(e) if !found.is_empty() => {
                warn!(error = %crate::error_chain(&e), "cannot read the maintenance event");
                return Ok(found);
            }
            Err(e) => return Err(e),
        };
        if event != self.maintenance && event.starts_with("TERMINATE") {
            found.push(notice(
                NoticeKind::Preemption,
                MAINTENANCE_WINDOW,
                format!("maintenance event {event}"),
            ));
        }
        self.maintenance = event;
        Ok(found)
    }

    /// Whether the VM is being preempted; waits (up to `wait`) for a change once the value is
    /// known.
    async fn preempted_now(&mut self) -> Result<bool, NoticeError> {
        let mut url = format!("{}{PREEMPTED_PATH}", self.base);
        if let Some(etag) = &self.etag {
            let secs = self.wait.as_secs().max(1);
            url = format!("{url}?wait_for_change=true&timeout_sec={secs}&last_etag={etag}");
        }
        let Answer { status, etag, body } = self.get(&url).await?;
        expect(status, &url, &[])?;
        self.etag = etag;
        match body.trim() {
            "TRUE" => Ok(true),
            "FALSE" => Ok(false),
            other => {
                Err(NoticeError::Answer { url, reason: format!("preempted is {other:?}, not TRUE or FALSE") })
            }
        }
    }

    async fn get(&self, url: &str) -> Result<Answer, NoticeError> {
        send(self.client.get(url).header(FLAVOR.0, FLAVOR.1), url).await
    }
}

fn notice(kind: NoticeKind, window: Duration, detail: String) -> Notice {
    Notice { cloud: Cloud::Gcp, kind, deadline: SystemTime::now() + window, detail, done: None }
}
