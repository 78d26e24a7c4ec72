//! Driving `stasis-memtest` (see `src/bin/memtest.rs`) by its signals, and reading its answers.

use nix::sys::signal::Signal;

use crate::{TIMEOUT, Workload, bin, expect_within, procfs};

/// The command line of `stasis-memtest` with `threads` threads of `mib` MiB each.
pub fn argv(threads: usize, mib: usize) -> Vec<String> {
    vec![bin("stasis-memtest").to_string_lossy().into_owned(), threads.to_string(), mib.to_string()]
}

/// What a paused memtest said: `paused checksum=<hex> iterations=<n>`.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Paused {
    /// The checksum of all its memory.
    pub checksum: String,
    /// Batches its threads had written in all.
    pub iterations: u64,
}

/// Sends `signal` to memtest `w` and returns its next log line that `matches`.
fn ask(w: &Workload, signal: Signal, what: &str, matches: impl Fn(&str) -> bool) -> String {
    let seen = w.lines().len();
    procfs::signal(w.pid, signal);
    w.wait_line_after(seen, what, matches).1
}

/// Waits until memtest `w` has written all its memory once (`ready`).
pub fn wait_ready(w: &Workload) {
    w.wait_line_after(0, "memtest `ready`", |l| l == "ready");
}

/// Pauses running memtest `w` (SIGUSR1): its threads park between two batches.
pub fn pause(w: &Workload) -> Paused {
    let line = ask(w, Signal::SIGUSR1, "memtest `paused ...`", |l| l.starts_with("paused "));
    let field = |name: &str| line.split_whitespace().find_map(|f| f.strip_prefix(name));
    match (field("checksum="), field("iterations=").and_then(|n| n.parse().ok())) {
        (Some(checksum), Some(iterations)) => Paused { checksum: checksum.to_owned(), iterations },
        _ => panic!("malformed memtest line: {line}"),
    }
}

/// The checksum of paused memtest `w`'s memory, computed afresh (SIGUSR2).
pub fn checksum(w: &Workload) -> String {
    let line = ask(w, Signal::SIGUSR2, "memtest `checksum=...`", |l| l.starts_with("checksum="));
    line["checksum=".len()..].to_owned()
}

/// Lets paused memtest `w` go on (SIGUSR1) until its threads have written more than
/// `iterations` batches in all, and pauses it again; returns what it said then.
pub fn run_past(w: &Workload, iterations: u64) -> Paused {
    expect_within(TIMEOUT, &format!("memtest's threads to work past {iterations} batches"), || {
        ask(w, Signal::SIGUSR1, "memtest `resumed`", |l| l == "resumed");
        Some(pause(w)).filter(|now| now.iterations > iterations)
    })
}
