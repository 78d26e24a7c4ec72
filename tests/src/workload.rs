//! A workload started through the CLI, and what it printed.

use std::path::PathBuf;

use serde_json::Value;

use crate::{Daemon, TIMEOUT, complete_lines, expect_within, numbered, pid_of, procfs};

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
    /// The process running the command: the tree's root, or, where the root is the init of
    /// the workload's own pid namespace (stasis-init), the init's child.
    pub fn main_pid(&self) -> i32 {
        procfs::command_of(self.pid)
    }

    /// Asks memhog.py (its init passes SIGUSR2 on) for the SHA-256 of its memory, and waits
    /// for the answer after the log's current lines.
    pub fn memhog_checksum(&self) -> String {
        let skip = self.lines().len();
        procfs::signal(self.pid, nix::sys::signal::Signal::SIGUSR2);
        let (_, line) = self.wait_line_after(skip, "memhog's checksum", |l| l.starts_with("checksum "));
        line["checksum ".len()..].to_owned()
    }

    /// The thread ids of its command, as its pid namespace numbers them (the same across
    /// restores).
    pub fn threads(&self) -> std::collections::BTreeSet<i32> {
        procfs::tids(self.main_pid()).into_iter().map(procfs::inner).collect()
    }

    /// Takes on the tree that the restore result `r` names, checking its pids: a tree in a pid
    /// namespace of its own has new pids outside it, the checkpointed ones inside (its root
    /// is the namespace's init again); any other has the checkpointed pids.
    pub fn restored(&mut self, r: &Value) {
        let pid = pid_of(r);
        if !procfs::is_namespace_init(pid) {
            assert_eq!(pid, self.pid, "the restored tree must have the checkpointed pid: {r}");
        }
        self.pid = pid;
    }

    /// [`Workload::restored`] by daemon `d`, another node's: its output now goes to `d`'s log
    /// of it.
    pub fn restored_on(&mut self, d: &Daemon, r: &Value) {
        self.restored(r);
        self.log = d.known(&self.name, &self.argv).log;
    }

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
