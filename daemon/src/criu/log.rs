//! Picking the useful part out of CRIU's log.

use std::fs::File;
use std::io::{Read, Seek, SeekFrom};
use std::path::Path;

/// How much of the end of the log is read.
const READ_BYTES: u64 = 256 * 1024;
/// Error lines kept, counted from the end.
const ERROR_LINES: usize = 12;
/// Plain last lines kept.
const LAST_LINES: usize = 6;

/// The last error lines of `dir/criu.log` followed by its last few lines; empty when there is
/// no log.
pub fn tail(dir: &Path) -> String {
    let Ok(mut file) = File::open(dir.join(super::LOG_FILE)) else { return String::new() };
    let len = file.metadata().map(|m| m.len()).unwrap_or(0);
    let _ = file.seek(SeekFrom::Start(len.saturating_sub(READ_BYTES)));
    let mut raw = Vec::new();
    if file.read_to_end(&mut raw).is_err() {
        return String::new();
    }
    select(&String::from_utf8_lossy(&raw))
}

fn select(text: &str) -> String {
    let lines: Vec<&str> = text.lines().collect();
    let errors: Vec<usize> = (0..lines.len()).filter(|&i| is_error(lines[i])).collect();
    let mut keep: Vec<usize> = errors[errors.len().saturating_sub(ERROR_LINES)..].to_vec();
    keep.extend(lines.len().saturating_sub(LAST_LINES)..lines.len());
    keep.sort_unstable();
    keep.dedup();
    keep.iter().map(|&i| lines[i]).collect::<Vec<_>>().join("\n")
}

fn is_error(line: &str) -> bool {
    line.contains("Error (") || line.contains("Error:") || line.contains("Warn  (")
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn keeps_errors_and_the_last_lines() {
        let mut log = String::new();
        log.push_str("(00.001) Error (criu/files.c:10): early failure\n");
        for i in 0..50 {
            log.push_str(&format!("(00.1) line {i}\n"));
        }
        let out = select(&log);
        assert!(out.starts_with("(00.001) Error (criu/files.c:10): early failure"));
        assert!(out.ends_with("(00.1) line 49"));
        assert!(!out.contains("line 10\n"));
        assert_eq!(out.lines().count(), 1 + LAST_LINES);
    }
}
