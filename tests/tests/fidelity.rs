//! Kernel features ordinary programs use, checkpointed and restored as plain CRIU would: an
//! open-file-description lock (which /proc/locks shows without a pid) is seen and held again
//! after the restore; a pseudo-terminal whose both sides the tree holds (tmux, screen,
//! expect) is the tree's own, restored as it was rather than swapped for a new terminal, and so
//! is /dev/tty opened on it by the session it controls; an evicted tree whose parent reaps it
//! late counts as gone once it is dead; memory the tree cleared (pages of zeros it wrote)
//! comes back as resident memory of its own, as after CRIU's restore.

#![forbid(unsafe_code)]

use std::os::unix::fs::MetadataExt;

use stasis_tests::{
    Daemon, DaemonOptions, TIMEOUT, expect_within, procfs, python_workload, skip_unless_ready,
};

/// Whether /proc/locks lists an open-file-description lock on the file with inode `ino`.
fn ofd_locked(ino: u64) -> bool {
    let locks = std::fs::read_to_string("/proc/locks").unwrap();
    locks.lines().any(|l| {
        l.contains("OFDLCK") && l.split_whitespace().nth(5).is_some_and(|id| id.ends_with(&format!(":{ino}")))
    })
}

#[test]
fn an_open_file_description_lock_is_checkpointed_and_held_again() {
    skip_unless_ready!();
    let d = Daemon::start();
    let file = d.dir().join("locked");
    let mut w = d.run("ofd-lock", &python_workload("ofd_lock.py", &[file.to_str().unwrap()]));
    w.wait_number("count ", 3);
    let ino = std::fs::metadata(&file).unwrap().ino();
    assert!(ofd_locked(ino), "the workload holds its lock");

    d.evict_and_restore(&mut w, &[]);
    let before = w.last_number("count ").unwrap();
    w.wait_number("count ", before + 5);
    assert!(ofd_locked(ino), "the restored workload holds its lock again");
}

#[test]
fn a_pseudo_terminal_the_tree_holds_both_sides_of_is_restored_as_its_own() {
    skip_unless_ready!();
    let d = Daemon::start();
    let mut w = d.run("pty-pair", &python_workload("pty_pair.py", &[]));
    w.wait_number("pty ", 5);

    d.evict_and_restore(&mut w, &[]);
    let before = w.last_number("pty ").unwrap();
    let after = w.wait_number("pty ", before + 10);
    let numbers = w.numbers("pty ");
    assert!(
        numbers.windows(2).all(|p| p[1] == p[0] + 1),
        "the exchange over the terminal goes on where it stopped (up to {after}): {numbers:?}"
    );
}

#[test]
fn dev_tty_on_a_terminal_the_tree_owns_is_restored_for_its_session_leader_and_child() {
    skip_unless_ready!();
    let d = Daemon::start();
    let mut w = d.run("tty-owner", &python_workload("tty_owner.py", &[]));
    w.wait_number("tty parent ", 3);
    w.wait_number("tty child ", 3);
    // Only the first process to hold /dev/tty in CRIU's order is checked: its child, which
    // holds it too, is not refused for the terminal its parent holds first.
    d.evict_and_restore(&mut w, &[]);
    for who in ["tty parent ", "tty child "] {
        let before = w.last_number(who).unwrap();
        w.wait_number(who, before + 5);
    }
    let root = procfs::command_of(w.pid);
    let holds_tty = |pid: i32| {
        std::fs::read_dir(format!("/proc/{pid}/fd"))
            .unwrap()
            .flatten()
            .any(|fd| std::fs::read_link(fd.path()).is_ok_and(|t| t == std::path::Path::new("/dev/tty")))
    };
    assert!(holds_tty(root), "the restored session leader holds /dev/tty again");
}

#[test]
fn an_eviction_does_not_wait_for_a_parent_that_reaps_late() {
    skip_unless_ready!();
    let d = Daemon::start();
    // A job whose parent (this test, for now) does not reap it: killed, it stays a zombie.
    // It leads a session of its own (setsid(1) execs in place, keeping the pid), and has stdio
    // of its own: the test runner's session leader may sit outside this pid namespace and its
    // stdio be a CI agent's socket (as on CI), neither of which CRIU can record.
    let out = d.dir().join("counter.out");
    let mut job = std::process::Command::new("setsid")
        .args(python_workload("counter.py", &[]))
        .stdin(std::process::Stdio::null())
        .stdout(std::fs::File::create(&out).unwrap())
        .stderr(std::process::Stdio::null())
        .spawn()
        .unwrap();
    let pid = job.id() as i32;
    expect_within(TIMEOUT, "the job to count", || {
        (stasis_tests::numbered(&stasis_tests::complete_lines(&out), "count ").len() >= 3).then_some(())
    });
    let ck = d.json(&["checkpoint", &pid.to_string(), "--json"]);
    assert_eq!(ck["left_running"], false, "{ck}");
    assert_eq!(procfs::proc_state(pid), Some('Z'), "the job is dead, its parent has not reaped it");
    let log = d.log_tail(200);
    assert!(!log.contains("still present"), "stasisd waited for the zombie:\n{log}");
    job.wait().unwrap();
    let r = d.json(&["restore", ck["id"].as_str().unwrap(), "--json"]);
    assert!(procfs::running(stasis_tests::pid_of(&r)), "{r}");
    procfs::kill9(stasis_tests::pid_of(&r));
}

/// A program that holds 16 MiB of random bytes and 64 MiB it cleared (wrote zeros to) is
/// evicted and restored with `restore` flags: its memory is what it was, and the cleared
/// part is resident again, its own, before the program touches it. Served as the shared zero
/// page instead, it would hold a fraction of what it held, and allocate the rest on its first
/// writes, past the point where a restore can still fail cleanly for want of memory.
fn cleared_memory_comes_back_resident(options: &DaemonOptions, restore: &[&str]) {
    let d = Daemon::start_with(options);
    let mut w = d.run("cleared", &python_workload("memhog.py", &["16", "64"]));
    w.wait_line_after(0, "memhog to be ready", |l| l == "ready");
    let sum = w.memhog_checksum();
    let before = procfs::rollup_kib(w.main_pid(), "Anonymous").unwrap();
    assert!(before >= 80 << 10, "memhog holds its 80 MiB before the checkpoint: {before} KiB");

    d.evict_and_restore(&mut w, restore);
    let after = procfs::rollup_kib(w.main_pid(), "Anonymous").unwrap();
    let ratio = after as f64 / before as f64;
    assert!(
        ratio >= 0.95,
        "{restore:?}: the restored program holds {after} KiB of anonymous memory, {before} KiB \
         before the checkpoint (x{ratio:.2}): its cleared memory did not come back as its own"
    );
    assert_eq!(w.memhog_checksum(), sum, "{restore:?}: the restored memory differs");
}

#[test]
fn an_eager_restore_gives_back_cleared_memory_resident() {
    skip_unless_ready!();
    cleared_memory_comes_back_resident(&DaemonOptions::default(), &[]);
}

#[test]
fn a_lazy_restore_gives_back_cleared_memory_resident() {
    skip_unless_ready!();
    cleared_memory_comes_back_resident(&DaemonOptions::default(), &["--lazy"]);
}

#[test]
fn a_restore_from_image_files_gives_back_cleared_memory_resident() {
    skip_unless_ready!();
    let options =
        DaemonOptions { args: vec!["--eager-restore".into(), "files".into()], ..Default::default() };
    cleared_memory_comes_back_resident(&options, &[]);
}
