//! A workload started through the CLI, and what it printed.

use std::path::PathBuf;

use crate::{TIMEOUT, complete_lines, expect_within, numbered};

/// A workload started by [`Daemon::run`].
#[derive(Debug, Clone)]
pub struct Workload {
    pub name: String,
    pub pid: i32,
    /// Where its stdout and stderr go.
    pub log: PathBuf,
    pub argv: Vec<String>,
}

impl Workload {
    /// The complete lines of its log so far.
    pub fn lines(&self) -> Vec<String> {
        complete_lines(&self.log)
    }

    /// The numbers of its log lines `<prefix><number> ...`, in order.
    pub fn numbers(&self, prefix: &str) -> Vec<u64> {
        numbered(&self.lines(), prefix)
    }

    /// The last such number, if any.
    pub fn last_number(&self, prefix: &str) -> Option<u64> {
        self.numbers(prefix).last().copied()
    }

    /// Waits until its log has a line `<prefix><n>` with `n >= at_least`; returns that `n`.
    pub fn wait_number(&self, prefix: &str, at_least: u64) -> u64 {
        expect_within(TIMEOUT, &format!("`{prefix}N` with N >= {at_least} in {}", self.log.display()), || {
            self.last_number(prefix).filter(|n| *n >= at_least)
        })
    }

    /// Waits until its log has more than `skip` complete lines and one of the new ones
    /// satisfies `matches`; returns that line's index and text.
    pub fn wait_line_after(
        &self,
        skip: usize,
        what: &str,
        matches: impl Fn(&str) -> bool,
    ) -> (usize, String) {
        expect_within(TIMEOUT, what, || {
            self.lines().into_iter().enumerate().skip(skip).find(|(_, line)| matches(line))
        })
    }
}
