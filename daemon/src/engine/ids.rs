//! Checkpoint ids and time stamps.
//!
//! An id is `YYYYMMDD-HHMMSS-xxxxxx` (UTC time of the checkpoint, then 24 random bits): it
//! sorts by time, is short enough to type, and is a safe object-key and file name.

use std::time::{SystemTime, UNIX_EPOCH};

use jiff::Timestamp;

/// Milliseconds since the Unix epoch.
pub fn now_unix_ms() -> u64 {
    SystemTime::now().duration_since(UNIX_EPOCH).map(|d| d.as_millis() as u64).unwrap_or(0)
}

/// A new checkpoint id for a checkpoint taken at `unix_ms`.
pub fn checkpoint_id(unix_ms: u64) -> String {
    // Past jiff's range (the end of the year 9999) the time stays at its end: four-digit years.
    let time =
        Timestamp::from_millisecond(i64::try_from(unix_ms).unwrap_or(i64::MAX)).unwrap_or(Timestamp::MAX);
    let tag: u32 = rand::random::<u32>() & 0xff_ffff;
    format!("{}-{tag:06x}", time.strftime("%Y%m%d-%H%M%S"))
}

/// Whether `id` has the shape of a checkpoint id (so it is safe to use in keys and paths).
pub fn valid_checkpoint_id(id: &str) -> bool {
    let b = id.as_bytes();
    b.len() == 22
        && b.iter().enumerate().all(|(i, c)| match i {
            8 | 15 => *c == b'-',
            16.. => c.is_ascii_hexdigit(),
            _ => c.is_ascii_digit(),
        })
}

/// A duration in whole milliseconds, as stats report it.
pub(super) fn ms(d: std::time::Duration) -> u64 {
    d.as_millis() as u64
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn ids_have_time_and_shape() {
        // 2026-11-22T08:35:58Z
        let id = checkpoint_id(1_795_336_558_000);
        assert!(id.starts_with("20261122-083558-"), "{id}");
        assert!(valid_checkpoint_id(&id));
        assert!(!valid_checkpoint_id("20261122-083558-zzzzzz"));
        assert!(!valid_checkpoint_id("../../etc/passwd"));
        // Milliseconds are cut, not rounded; the epoch and a leap day.
        assert!(checkpoint_id(1_795_336_558_999).starts_with("20261122-083558-"));
        assert!(checkpoint_id(0).starts_with("19700101-000000-"));
        assert!(checkpoint_id(951_782_400_000).starts_with("20000229-000000-"));
        assert!(valid_checkpoint_id(&checkpoint_id(u64::MAX)));
    }
}
