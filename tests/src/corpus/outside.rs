//! Programs started outside stasis, by this test, and the end of any tree.
//!
//! This process makes itself a child subreaper: the processes of a tree it started (or that
//! plain CRIU restored for it) become its children when their parents die, instead of pid 1's,
//! which in a container may never reap them, leaving their pids taken for the restore. It
//! reaps them by pid, never any child, since other tests of this process wait for theirs.

use std::fs::File;
use std::path::Path;
use std::process::{Command, Stdio};
use std::sync::Once;

use nix::errno::Errno;
use nix::sys::wait::{WaitPidFlag, WaitStatus, waitpid};
use nix::unistd::Pid;

use super::Tree;
use crate::{TIMEOUT, procfs, wait_for};

fn become_subreaper() {
    static ONCE: Once = Once::new();
    ONCE.call_once(|| nix::sys::prctl::set_child_subreaper(true).expect("PR_SET_CHILD_SUBREAPER"));
}

/// Starts `argv` in `dir` as a child of this test, with stdin from /dev/null and stdout and
/// stderr appended to `dir/log`.
///
/// It runs in this test's session (a shell job), as a program started from a terminal does,
/// unless that session's leader is outside this pid namespace (as where the tests run in a
/// container): neither CRIU nor stasis can record such a tree, so it then leads a session of
/// its own (setsid(1) execs in place, keeping the pid), as a service does. Every driver starts
/// its programs here, so each is compared on the same tree.
pub(super) fn spawn(argv: &[String], dir: &Path) -> Tree {
    become_subreaper();
    let argv: Vec<String> = if session_leader_outside() {
        std::iter::once("setsid".to_owned()).chain(argv.iter().cloned()).collect()
    } else {
        argv.to_vec()
    };
    let log = dir.join("log");
    // Appended, as a shell's `>>` would: CRIU checks the size of other files it restores.
    let out = File::options().create(true).append(true).open(&log).expect("the program's log");
    #[expect(clippy::zombie_processes, reason = "reaped by pid, in `reap`, as its descendants are")]
    let child = Command::new(&argv[0])
        .args(&argv[1..])
        .current_dir(dir)
        .stdin(Stdio::null())
        .stdout(out.try_clone().expect("the program's log"))
        .stderr(out)
        .spawn()
        .unwrap_or_else(|e| panic!("starting {argv:?}: {e}"));
    Tree { root: child.id() as i32, log }
}

/// Whether this process's session leader is outside its pid namespace (getsid reports 0).
fn session_leader_outside() -> bool {
    nix::unistd::getsid(None).expect("getsid of this process").as_raw() == 0
}

/// Waits until each of `pids` is gone: reaped here when this process is its parent, else by
/// whoever is.
pub(super) fn reap(pids: &[i32]) {
    for &pid in pids {
        let gone = wait_for(TIMEOUT, || match waitpid(Pid::from_raw(pid), Some(WaitPidFlag::WNOHANG)) {
            Ok(WaitStatus::StillAlive) => None,
            Ok(_) => Some(()),
            Err(Errno::ECHILD) => (!procfs::exists(pid)).then_some(()),
            Err(e) => panic!("waitpid {pid}: {e}"),
        });
        assert!(gone.is_some(), "pid {pid} is still there ({:?}) after {TIMEOUT:?}", procfs::proc_state(pid));
    }
}

/// Kills the tree rooted at `root` (SIGKILL to each process) and waits until it is gone.
pub(super) fn kill_tree(root: i32) {
    let pids: Vec<i32> = std::iter::once(root).chain(procfs::descendants(root)).collect();
    for &pid in &pids {
        procfs::kill9(pid);
    }
    reap(&pids);
}
