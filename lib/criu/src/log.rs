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

/// Errors CRIU reports that do not make an operation fail.
const BENIGN: &[&str] = &["Can't setup RLIMIT_NOFILE"];

/// The last error lines of `dir/criu.log` followed by its last few lines; empty when there is
/// no log.
pub fn tail(dir: &Path) -> String {
    tail_of(&dir.join(super::LOG_FILE))
}

/// Like [`tail`], for the log file at `path`.
pub fn tail_of(path: &Path) -> String {
    select(&read_end(path))
}

/// The first error in `dir/criu.log` that is not a known harmless one, without its time
/// stamp: usually the cause, where later errors are its consequences.
pub fn first_error(dir: &Path) -> Option<String> {
    read_end(&dir.join(super::LOG_FILE)).lines().find_map(|line| {
        let line = line.trim();
        (is_error(line) && !line.contains("Warn  (") && !is_benign(line))
            .then(|| strip_timestamp(line).to_string())
    })
}

pub fn is_benign(message: &str) -> bool {
    BENIGN.iter().any(|b| message.contains(b))
}

fn strip_timestamp(line: &str) -> &str {
    match line.strip_prefix('(').and_then(|l| l.split_once(") ")) {
        Some((stamp, rest)) if stamp.chars().all(|c| c.is_ascii_digit() || c == '.') => rest,
        _ => line,
    }
}

fn read_end(path: &Path) -> String {
    let Ok(mut file) = File::open(path) else {
        return String::new();
    };
    let len = file.metadata().map(|m| m.len()).unwrap_or(0);
    let _ = file.seek(SeekFrom::Start(len.saturating_sub(READ_BYTES)));
    let mut raw = Vec::new();
    if file.read_to_end(&mut raw).is_err() {
        return String::new();
    }
    String::from_utf8_lossy(&raw).into_owned()
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
    fn first_error_skips_benign_ones_and_time_stamps() {
        let dir = tempfile::tempdir().unwrap();
        let log = "(00.03) Error (criu/util.c:1533): rlimit: Can't setup RLIMIT_NOFILE for self\n\
                   (00.04) Warn  (criu/x.c:1): something odd\n\
                   pie: 7: Error (criu/pie/parasite.c:588): send_fds failed (-22)\n\
                   (00.05) Error (criu/cr-dump.c:2111): Dumping FAILED.\n";
        std::fs::write(dir.path().join(crate::LOG_FILE), log).unwrap();
        assert_eq!(
            first_error(dir.path()).as_deref(),
            Some("pie: 7: Error (criu/pie/parasite.c:588): send_fds failed (-22)")
        );
        assert_eq!(strip_timestamp("(00.05) Error (a): b"), "Error (a): b");
        assert!(first_error(&dir.path().join("missing")).is_none());
    }

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
