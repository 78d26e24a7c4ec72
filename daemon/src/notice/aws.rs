//! AWS: the instance metadata service, version 2 (a session token first, then every request
//! carries it). A spot interruption shows as `spot/instance-action` (404 until there is one,
//! then `{"action": "terminate", "time": "..."}`, two minutes ahead); a rebalance
//! recommendation as `events/recommendations/rebalance` (`{"noticeTime": "..."}`).

use std::time::{Duration, Instant, SystemTime};

use serde::Deserialize;
use tracing::warn;

use super::{Answer, Cloud, Notice, NoticeError, NoticeKind, expect, rfc3339, send};

const TOKEN_PATH: &str = "/latest/api/token";
const ACTION_PATH: &str = "/latest/meta-data/spot/instance-action";
const REBALANCE_PATH: &str = "/latest/meta-data/events/recommendations/rebalance";
const TTL_HEADER: &str = "X-aws-ec2-metadata-token-ttl-seconds";
const TOKEN_HEADER: &str = "X-aws-ec2-metadata-token";
/// What a spot interruption gives.
const WINDOW: Duration = Duration::from_secs(120);
/// The session length asked for (the most IMDS grants: six hours).
const TOKEN_TTL_SECS: u64 = 21_600;

/// What `spot/instance-action` holds once an interruption is scheduled.
#[derive(Debug, Deserialize)]
struct InstanceAction {
    action: String,
    time: String,
}

/// What the rebalance recommendation holds.
#[derive(Debug, Deserialize)]
struct Rebalance {
    #[serde(rename = "noticeTime")]
    notice_time: String,
}

pub struct Imds {
    client: reqwest::Client,
    base: String,
    /// The session token and when to get a new one.
    token: Option<(String, Instant)>,
    /// What was reported already (each notice once).
    seen_action: Option<String>,
    seen_rebalance: Option<String>,
}

impl Imds {
    pub fn new(client: reqwest::Client, base: String) -> Self {
        Self { client, base, token: None, seen_action: None, seen_rebalance: None }
    }

    pub async fn poll(&mut self) -> Result<Vec<Notice>, NoticeError> {
        let mut found = Vec::new();
        if let Some(body) = self.get(ACTION_PATH).await?
            && self.seen_action.as_deref() != Some(body.as_str())
        {
            let url = format!("{}{ACTION_PATH}", self.base);
            let action: InstanceAction = serde_json::from_str(&body)
                .map_err(|e| NoticeError::Answer { url, reason: e.to_string() })?;
            // An interruption is coming either way: a time that does not parse means the usual
            // two minutes.
            let deadline = rfc3339(&action.time).unwrap_or_else(|| SystemTime::now() + WINDOW);
            found.push(Notice {
                cloud: Cloud::Aws,
                kind: NoticeKind::Preemption,
                deadline,
                detail: format!("spot instance-action {} at {}", action.action, action.time),
                done: None,
            });
            self.seen_action = Some(body);
        }
        match self.rebalance().await {
            Ok(rebalance) => found.extend(rebalance),
            // The interruption found above must not be lost with this answer.
            Err(e) if !found.is_empty() => {
                warn!(error = %crate::error_chain(&e), "cannot read the rebalance recommendation")
            }
            Err(e) => return Err(e),
        }
        Ok(found)
    }

    /// The rebalance recommendation, if there is a new one.
    async fn rebalance(&mut self) -> Result<Option<Notice>, NoticeError> {
        let Some(body) = self.get(REBALANCE_PATH).await? else { return Ok(None) };
        if self.seen_rebalance.as_deref() == Some(body.as_str()) {
            return Ok(None);
        }
        let url = format!("{}{REBALANCE_PATH}", self.base);
        let rebalance: Rebalance =
            serde_json::from_str(&body).map_err(|e| NoticeError::Answer { url, reason: e.to_string() })?;
        self.seen_rebalance = Some(body);
        Ok(Some(Notice {
            cloud: Cloud::Aws,
            kind: NoticeKind::Rebalance,
            deadline: rfc3339(&rebalance.notice_time).unwrap_or_else(SystemTime::now),
            detail: format!("rebalance recommendation of {}", rebalance.notice_time),
            done: None,
        }))
    }

    /// The body at `path`, `None` for 404; a rejected token is replaced once.
    async fn get(&mut self, path: &str) -> Result<Option<String>, NoticeError> {
        let url = format!("{}{path}", self.base);
        for _ in 0..2 {
            let token = self.token().await?;
            let Answer { status, body, .. } =
                send(self.client.get(&url).header(TOKEN_HEADER, token), &url).await?;
            match expect(status, &url, &[401, 404])?.as_u16() {
                401 => self.token = None,
                404 => return Ok(None),
                _ => return Ok(Some(body)),
            }
        }
        Err(NoticeError::Answer { url, reason: "a fresh session token was refused".into() })
    }

    /// The session token, fetched anew when missing or near its end.
    async fn token(&mut self) -> Result<String, NoticeError> {
        if let Some((token, renew_at)) = &self.token
            && Instant::now() < *renew_at
        {
            return Ok(token.clone());
        }
        let url = format!("{}{TOKEN_PATH}", self.base);
        let request = self.client.put(&url).header(TTL_HEADER, TOKEN_TTL_SECS.to_string());
        let Answer { status, body: token, .. } = send(request, &url).await?;
        expect(status, &url, &[])?;
        let token = token.trim().to_owned();
        if token.is_empty() {
            return Err(NoticeError::Answer { url, reason: "an empty session token".into() });
        }
        // Renewed well before it ends: a request never carries a token about to lapse.
        let renew_at = Instant::now() + Duration::from_secs(TOKEN_TTL_SECS / 2);
        self.token = Some((token.clone(), renew_at));
        Ok(token)
    }
}
