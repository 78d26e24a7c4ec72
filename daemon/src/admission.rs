//! What keeps a listening socket serving whoever connects to it: at most so many connections
//! at once, fewer from any one uid, and an accept that fails (out of descriptors, say) waited
//! out instead of ending the loop or spinning on it. The pod endpoint (any local user may
//! connect) and the metrics server use it.

use std::collections::HashMap;
use std::sync::{Arc, Mutex};
use std::time::Duration;

use tokio::sync::{OwnedSemaphorePermit, Semaphore};
use tracing::warn;

/// The longest wait between tries after failed accepts.
const MAX_BACKOFF: Duration = Duration::from_secs(1);

/// The connections each uid has open.
type ByUid = Arc<Mutex<HashMap<u32, usize>>>;

/// The connections a server takes: `total` at once, `per_uid` of them from one uid.
#[derive(Debug, Clone)]
pub struct Admission {
    slots: Arc<Semaphore>,
    per_uid: usize,
    by_uid: ByUid,
}

/// A connection's places; given back when dropped.
#[derive(Debug)]
pub struct Admitted {
    _slot: OwnedSemaphorePermit,
    uid: Option<(u32, ByUid)>,
}

impl Drop for Admitted {
    fn drop(&mut self) {
        if let Some((uid, by_uid)) = &self.uid {
            let mut by_uid = by_uid.lock().unwrap_or_else(|p| p.into_inner());
            if let Some(n) = by_uid.get_mut(uid) {
                *n -= 1;
                if *n == 0 {
                    by_uid.remove(uid);
                }
            }
        }
    }
}

impl Admission {
    pub fn new(total: usize, per_uid: usize) -> Admission {
        Admission { slots: Arc::new(Semaphore::new(total)), per_uid, by_uid: Default::default() }
    }

    /// A place among the `total`, waiting for one: call before accepting, so that a full server
    /// leaves new connections in the listen queue instead of taking them on.
    pub async fn slot(&self) -> OwnedSemaphorePermit {
        self.slots.clone().acquire_owned().await.expect("the semaphore is never closed")
    }

    /// Admits a connection from `uid` holding `slot`; `None` when that uid has `per_uid`
    /// connections already (the connection is then to be closed at once).
    pub fn admit(&self, slot: OwnedSemaphorePermit, uid: Option<u32>) -> Option<Admitted> {
        let Some(uid) = uid else { return Some(Admitted { _slot: slot, uid: None }) };
        let mut by_uid = self.by_uid.lock().unwrap_or_else(|p| p.into_inner());
        let n = by_uid.entry(uid).or_default();
        if *n >= self.per_uid {
            return None;
        }
        *n += 1;
        Some(Admitted { _slot: slot, uid: Some((uid, self.by_uid.clone())) })
    }
}

/// Waits after the `failures`th accept in a row failed with `error` (10 ms, doubling up to a
/// second), and counts it.
pub async fn accept_failed(what: &str, error: &std::io::Error, failures: &mut u32) {
    if *failures == 0 {
        warn!(server = what, error = %error, "accepting a connection failed; trying again");
    }
    let wait = Duration::from_millis(10u64 << (*failures).min(7)).min(MAX_BACKOFF);
    *failures = failures.saturating_add(1);
    tokio::time::sleep(wait).await;
}

#[cfg(test)]
mod tests {
    use super::*;

    #[tokio::test]
    async fn one_uid_gets_its_share_and_gives_it_back() {
        let admission = Admission::new(4, 2);
        let a = admission.admit(admission.slot().await, Some(1000)).unwrap();
        let _b = admission.admit(admission.slot().await, Some(1000)).unwrap();
        assert!(admission.admit(admission.slot().await, Some(1000)).is_none(), "a third from 1000");
        let _c = admission.admit(admission.slot().await, Some(0)).expect("another uid still gets in");
        drop(a);
        assert!(admission.admit(admission.slot().await, Some(1000)).is_some(), "a place given back");
    }

    #[tokio::test]
    async fn a_full_server_waits_for_a_place() {
        let admission = Admission::new(1, 1);
        let held = admission.admit(admission.slot().await, None).unwrap();
        let waiting = tokio::time::timeout(Duration::from_millis(100), admission.slot()).await;
        assert!(waiting.is_err(), "a second place while the only one is held");
        drop(held);
        let again = tokio::time::timeout(Duration::from_secs(1), admission.slot()).await;
        assert!(again.is_ok(), "the place comes back");
    }

    #[tokio::test]
    async fn failed_accepts_back_off_up_to_a_second() {
        let error = std::io::Error::from_raw_os_error(libc::EMFILE);
        let mut failures = 0;
        let started = tokio::time::Instant::now();
        for _ in 0..3 {
            accept_failed("test", &error, &mut failures).await;
        }
        assert_eq!(failures, 3);
        assert!(started.elapsed() >= Duration::from_millis(70), "10 + 20 + 40 ms at least");
    }
}
