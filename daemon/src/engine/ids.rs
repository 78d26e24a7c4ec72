//! Checkpoint ids and time stamps.
//!
//! An id is `YYYYMMDD-HHMMSS-xxxxxx` (UTC time of the checkpoint, then 24 random bits): it
//! sorts by time, is short enough to type, and is a safe object-key and file name.

use std::time::{SystemTime, UNIX_EPOCH};

/// Milliseconds since the Unix epoch.
pub fn now_unix_ms() -> u64 {
    SystemTime::now().duration_since(UNIX_EPOCH).map(|d| d.as_millis() as u64).unwrap_or(0)
}

/// A new checkpoint id for a checkpoint taken at `unix_ms`.
pub fn checkpoint_id(unix_ms: u64) -> String {
    let (y, mo, d, h, mi, s) = civil_from_unix(unix_ms / 1000);
    let tag: u32 = rand::random::<u32>() & 0xff_ffff;
    format!("{y:04}{mo:02}{d:02}-{h:02}{mi:02}{s:02}-{tag:06x}")
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

/// (year, month, day, hour, minute, second) in UTC, by Howard Hinnant's days-to-civil method.
fn civil_from_unix(secs: u64) -> (i64, u32, u32, u32, u32, u32) {
    let days = (secs / 86_400) as i64;
    let rem = secs % 86_400;
    let z = days + 719_468;
    let era = z.div_euclid(146_097);
    let doe = z.rem_euclid(146_097);
    let yoe = (doe - doe / 1460 + doe / 36_524 - doe / 146_096) / 365;
    let doy = doe - (365 * yoe + yoe / 4 - yoe / 100);
    let mp = (5 * doy + 2) / 153;
    let day = (doy - (153 * mp + 2) / 5 + 1) as u32;
    let month = if mp < 10 { mp + 3 } else { mp - 9 } as u32;
    let year = yoe + era * 400 + i64::from(month <= 2);
    (year, month, day, (rem / 3600) as u32, (rem % 3600 / 60) as u32, (rem % 60) as u32)
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
        assert_eq!(civil_from_unix(0), (1970, 1, 1, 0, 0, 0));
        assert_eq!(civil_from_unix(951_782_400), (2000, 2, 29, 0, 0, 0));
    }
}
