//! Who starts, checkpoints and restores a case: stasis, for a program it runs or one it is
//! given by pid (and plain CRIU, in plain_criu.rs).

use std::path::Path;

use serde_json::Value;

use super::{Tree, outside};
use crate::{Daemon, TIMEOUT, expect_within, pid_of, procfs};

/// Starts, checkpoints and restores a case's program.
pub(super) trait Driver {
    /// How the program is started and by whom it is checkpointed, for the results.
    fn start_name(&self) -> &'static str;
    /// Starts `argv` with its working directory and log in `dir`.
    fn start(&mut self, argv: &[String], dir: &Path) -> Tree;
    /// Checkpoints `tree`; the checkpoint's id, or the refusal's reason when the tree was
    /// left as it was. Panics on other failures.
    fn checkpoint(&mut self, tree: &Tree, leave_running: bool) -> Result<String, String>;
    /// Waits until the checkpointed processes `pids` are gone (reaping those that are this
    /// test's), so that their pids are free for the restore.
    fn wait_gone(&mut self, pids: &[i32]) {
        outside::reap(pids);
    }
    /// Restores checkpoint `id`, eagerly or lazily (returning once its memory is resident),
    /// and points `tree` at the restored tree. Panics when that fails.
    fn restore(&mut self, tree: &mut Tree, id: &str, lazy: bool);
}

/// Runs `stasis checkpoint <target> --json [--leave-running]`: the checkpoint's id, or
/// stasis's error.
fn checkpoint(d: &Daemon, target: &[&str], leave_running: bool) -> Result<String, String> {
    let mut args = vec!["checkpoint"];
    args.extend_from_slice(target);
    args.push("--json");
    if leave_running {
        args.push("--leave-running");
    }
    let out = d.cli(&args);
    if !out.status.success() {
        return Err(String::from_utf8_lossy(&out.stderr).trim().to_owned());
    }
    let ck: Value = serde_json::from_slice(&out.stdout).expect("checkpoint --json prints JSON");
    assert_eq!(ck["left_running"], leave_running, "checkpoint result: {ck}");
    eprintln!("checkpoint: {}", ck["stats"]);
    Ok(ck["id"].as_str().unwrap_or_else(|| panic!("no id in {ck}")).to_owned())
}

/// Runs `stasis restore ID --json [--lazy]` and checks the answer; the restored root's pid.
fn restore(d: &Daemon, id: &str, lazy: bool) -> i32 {
    let mut args = vec!["restore", id, "--json"];
    if lazy {
        args.push("--lazy");
    }
    let r = d.json(&args);
    eprintln!("restore: {}", r["stats"]);
    assert_eq!(r["stats"]["lazy"], lazy, "restore result: {r}");
    if lazy {
        let resident = r["stats"]["resident_ms"].as_u64().unwrap_or(0);
        assert!(resident > 0, "a lazy restore that waited answers once resident: {r}");
    }
    let pid = pid_of(&r);
    assert!(procfs::running(pid), "the restored root {pid} is not running: {:?}", procfs::proc_state(pid));
    pid
}

/// stasis, with the program started by `stasis run` and checkpointed by workload name.
pub(super) struct StasisRun<'a> {
    d: &'a Daemon,
    case: String,
    started: usize,
}

impl<'a> StasisRun<'a> {
    pub(super) fn new(d: &'a Daemon, case: String) -> Self {
        StasisRun { d, case, started: 0 }
    }
}

impl Driver for StasisRun<'_> {
    fn start_name(&self) -> &'static str {
        "stasis run"
    }

    fn start(&mut self, argv: &[String], _dir: &Path) -> Tree {
        self.started += 1;
        let w = self.d.run(&format!("{}-{}", self.case, self.started), argv);
        Tree { root: w.pid, log: w.log }
    }

    fn checkpoint(&mut self, _tree: &Tree, leave_running: bool) -> Result<String, String> {
        let name = self.d.workload_name(&format!("{}-{}", self.case, self.started));
        checkpoint(self.d, &["--workload", &name], leave_running)
    }

    fn wait_gone(&mut self, pids: &[i32]) {
        // stasisd reaps the root (stasis-init), which reaps the rest.
        for &pid in pids {
            expect_within(TIMEOUT, &format!("pid {pid} of the evicted tree to be gone"), || {
                (!procfs::exists(pid)).then_some(())
            });
        }
    }

    fn restore(&mut self, tree: &mut Tree, id: &str, lazy: bool) {
        tree.root = restore(self.d, id, lazy);
    }
}

/// stasis, with the program started by this test and checkpointed by pid.
pub(super) struct StasisByPid<'a> {
    d: &'a Daemon,
}

impl<'a> StasisByPid<'a> {
    pub(super) fn new(d: &'a Daemon) -> Self {
        StasisByPid { d }
    }
}

impl Driver for StasisByPid<'_> {
    fn start_name(&self) -> &'static str {
        "by pid"
    }

    fn start(&mut self, argv: &[String], dir: &Path) -> Tree {
        outside::spawn(argv, dir)
    }

    fn checkpoint(&mut self, tree: &Tree, leave_running: bool) -> Result<String, String> {
        checkpoint(self.d, &[&tree.root.to_string()], leave_running)
    }

    fn restore(&mut self, tree: &mut Tree, id: &str, lazy: bool) {
        let pid = restore(self.d, id, lazy);
        assert_eq!(pid, tree.root, "a tree checkpointed by pid comes back with its pids");
    }
}
