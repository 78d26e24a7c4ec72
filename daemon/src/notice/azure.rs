//! Azure: Scheduled Events of the instance metadata service (every request says
//! `Metadata: true`). A spot eviction is a `Preempt` event (at least 30 s ahead, `NotBefore`
//! in RFC 1123 form); a deletion a `Terminate` event. Events name the VMs they affect; ours
//! is asked once. Once the engine is done with an event it is acknowledged (`StartRequests`),
//! which lets Azure go ahead without waiting out the window.

use std::collections::HashSet;
use std::time::{Duration, SystemTime};

use serde::Deserialize;
use tokio::sync::oneshot;
use tracing::{info, warn};

use super::{Answer, Cloud, Notice, NoticeError, NoticeKind, expect, send};

const EVENTS_PATH: &str = "/metadata/scheduledevents?api-version=2020-07-01";
const NAME_PATH: &str = "/metadata/instance/compute/name?api-version=2021-02-01&format=text";
const HEADER: (&str, &str) = ("Metadata", "true");
/// The least a `Preempt` event gives, used when an event has no `NotBefore`.
const MIN_WINDOW: Duration = Duration::from_secs(30);

#[derive(Debug, Deserialize)]
#[serde(rename_all = "PascalCase")]
struct Document {
    #[serde(default)]
    events: Vec<Event>,
}

#[derive(Debug, Deserialize)]
#[serde(rename_all = "PascalCase")]
struct Event {
    event_id: String,
    event_type: String,
    #[serde(default)]
    resources: Vec<String>,
    #[serde(default)]
    not_before: String,
}

pub struct ScheduledEvents {
    client: reqwest::Client,
    base: String,
    /// This VM's name, as events list it.
    vm: Option<String>,
    seen: HashSet<String>,
}

impl ScheduledEvents {
    pub fn new(client: reqwest::Client, base: String) -> Self {
        Self { client, base, vm: None, seen: HashSet::new() }
    }

    pub async fn poll(&mut self) -> Result<Vec<Notice>, NoticeError> {
        let vm = match &self.vm {
            Some(vm) => vm.clone(),
            None => {
                let url = format!("{}{NAME_PATH}", self.base);
                let Answer { status, body: name, .. } =
                    send(self.client.get(&url).header(HEADER.0, HEADER.1), &url).await?;
                expect(status, &url, &[])?;
                self.vm.insert(name.trim().to_owned()).clone()
            }
        };
        let url = format!("{}{EVENTS_PATH}", self.base);
        let Answer { status, body, .. } =
            send(self.client.get(&url).header(HEADER.0, HEADER.1), &url).await?;
        expect(status, &url, &[])?;
        let document: Document =
            serde_json::from_str(&body).map_err(|e| NoticeError::Answer { url, reason: e.to_string() })?;
        let mut found = Vec::new();
        for event in document.events {
            let ours = event.resources.is_empty() || event.resources.iter().any(|r| r == &vm);
            if !ours
                || !matches!(event.event_type.as_str(), "Preempt" | "Terminate")
                || !self.seen.insert(event.event_id.clone())
            {
                continue;
            }
            let deadline = rfc1123(&event.not_before).unwrap_or_else(|| SystemTime::now() + MIN_WINDOW);
            let (done, acked) = oneshot::channel();
            tokio::spawn(acknowledge(self.client.clone(), self.base.clone(), event.event_id.clone(), acked));
            found.push(Notice {
                cloud: Cloud::Azure,
                kind: NoticeKind::Preemption,
                deadline,
                detail: format!(
                    "scheduled event {} {} not before {:?}",
                    event.event_type, event.event_id, event.not_before
                ),
                done: Some(done),
            });
        }
        Ok(found)
    }
}

/// Once the engine is done (`acked` fires), tells Azure the event may start now.
async fn acknowledge(client: reqwest::Client, base: String, event_id: String, acked: oneshot::Receiver<()>) {
    if acked.await.is_err() {
        return;
    }
    let url = format!("{base}{EVENTS_PATH}");
    let body = serde_json::json!({ "StartRequests": [{ "EventId": event_id }] }).to_string();
    let request =
        client.post(&url).header(HEADER.0, HEADER.1).header("Content-Type", "application/json").body(body);
    match send(request, &url).await.and_then(|answer| expect(answer.status, &url, &[])) {
        Ok(_) => info!(event = %event_id, "scheduled event acknowledged: the machine may go"),
        Err(e) => {
            warn!(event = %event_id, error = %crate::error_chain(&e), "cannot acknowledge the scheduled event; it starts at its time")
        }
    }
}

/// Parses an RFC 1123 date (`Mon, 19 Sep 2016 18:29:47 GMT`).
fn rfc1123(text: &str) -> Option<SystemTime> {
    let zoned = jiff::fmt::rfc2822::parse(text.trim()).ok()?;
    Some(SystemTime::from(zoned.timestamp()))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn events_and_their_dates_parse() {
        let body = r#"{"DocumentIncarnation": 2, "Events": [{"EventId": "A1", "EventType": "Preempt",
            "ResourceType": "VirtualMachine", "Resources": ["vm-7"], "EventStatus": "Scheduled",
            "NotBefore": "Mon, 23 Nov 2026 15:00:10 GMT", "Description": "", "EventSource": "Platform",
            "DurationInSeconds": -1}]}"#;
        let doc: Document = serde_json::from_str(body).unwrap();
        assert_eq!(doc.events[0].event_id, "A1");
        assert_eq!(doc.events[0].resources, ["vm-7"]);
        let at = rfc1123(&doc.events[0].not_before).unwrap();
        assert_eq!(at, super::super::rfc3339("2026-11-23T15:00:10Z").unwrap());
        assert!(rfc1123("").is_none());
        let empty: Document = serde_json::from_str(r#"{"DocumentIncarnation": 0, "Events": []}"#).unwrap();
        assert!(empty.events.is_empty());
    }
}
