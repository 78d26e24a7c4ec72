//! Waiting, and reading what workloads print.

use std::path::Path;
use std::time::{Duration, Instant};

/// Calls `probe` every 20 ms until it returns `Some`, for at most `timeout`.
pub fn wait_for<T>(timeout: Duration, mut probe: impl FnMut() -> Option<T>) -> Option<T> {
    let deadline = Instant::now() + timeout;
    loop {
        if let Some(value) = probe() {
            return Some(value);
        }
        if Instant::now() >= deadline {
            return None;
        }
        std::thread::sleep(Duration::from_millis(20));
    }
}

/// [`wait_for`], panicking with `what` on timeout.
pub fn expect_within<T>(timeout: Duration, what: &str, probe: impl FnMut() -> Option<T>) -> T {
    wait_for(timeout, probe).unwrap_or_else(|| panic!("timed out after {timeout:?} waiting for {what}"))
}

/// The complete lines of a text file: a last line without its newline (still being written)
/// is left out. A missing file has no lines.
pub fn complete_lines(path: &Path) -> Vec<String> {
    let bytes = std::fs::read(path).unwrap_or_default();
    let text = String::from_utf8_lossy(&bytes);
    let complete = match text.rfind('\n') {
        Some(end) => &text[..end],
        None => return Vec::new(),
    };
    complete.split('\n').map(str::to_owned).collect()
}

/// The numbers of the lines of the form `<prefix><number>[ ...]`, in order; other lines are
/// skipped.
pub fn numbered(lines: &[String], prefix: &str) -> Vec<u64> {
    lines
        .iter()
        .filter_map(|line| line.strip_prefix(prefix))
        .filter_map(|rest| rest.split_whitespace().next()?.parse().ok())
        .collect()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn numbered_takes_the_first_word_after_the_prefix() {
        let lines: Vec<String> = ["count 1", "noise", "count 2 extra", "count x", "roundtrip 3"]
            .iter()
            .map(|s| s.to_string())
            .collect();
        assert_eq!(numbered(&lines, "count "), [1, 2]);
        assert_eq!(numbered(&lines, "roundtrip "), [3]);
    }

    #[test]
    fn complete_lines_drops_a_partial_last_line() {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("log");
        std::fs::write(&path, "a\nb\nhalf").unwrap();
        assert_eq!(complete_lines(&path), ["a", "b"]);
        std::fs::write(&path, "a\n").unwrap();
        assert_eq!(complete_lines(&path), ["a"]);
        std::fs::write(&path, "half").unwrap();
        assert!(complete_lines(&path).is_empty());
        assert!(complete_lines(&dir.path().join("missing")).is_empty());
    }
}
