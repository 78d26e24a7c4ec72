//! Shared anonymous memory, written or never written, survives a checkpoint: a tree holding a
//! `MAP_SHARED|MAP_ANONYMOUS` mapping nobody wrote (and a shared mapping of /dev/zero) restores,
//! eagerly and lazily, with the written mapping's bytes, the untouched ones reading as zeros,
//! and all of them still shared between the processes; `stasis check` finds the checkpoints
//! complete (issue 24, item 1: such a checkpoint was reported durable and never restored, CRIU
//! finding no `pagemap-shmem-N.img` for the untouched mapping).

#![forbid(unsafe_code)]

use nix::sys::signal::Signal;
use stasis_tests::{Daemon, TIMEOUT, Workload, expect_within, procfs, python_workload, skip_unless_ready};

/// The sha256 of 1 MiB of zeros: what a never-written mapping reads as.
const ZEROS_SHA256: &str = "30e14955ebf1352266dc2ff8067e68104607e750abb9d3b36582b8af909fcb58";

/// The written mapping's checksums both processes print after the first `skip` lines, once
/// both came, in pid order (the parent, started first, has the smaller one in its namespace).
fn sums(w: &Workload, skip: usize) -> Vec<String> {
    procfs::signal(w.main_pid(), Signal::SIGUSR2);
    expect_within(TIMEOUT, "both processes' `sums`", || {
        let lines = w.lines();
        let mut got: Vec<(i32, String)> = lines[skip.min(lines.len())..]
            .iter()
            .filter_map(|l| {
                let mut f = l.strip_prefix("sums ")?.split(' ');
                Some((f.next()?.parse().ok()?, f.next()?.to_owned()))
            })
            .collect();
        got.sort();
        (got.len() == 2).then(|| got.into_iter().map(|(_, sum)| sum).collect())
    })
}

/// The two checksums of the line `<prefix> <untouched> <zero>` printed after `skip` lines.
fn pair(w: &Workload, skip: usize, prefix: &str) -> (String, String) {
    let (_, line) = w.wait_line_after(skip, &format!("`{prefix} ...`"), |l| l.starts_with(prefix));
    let mut f = line.split(' ').skip(1).map(str::to_owned);
    (f.next().expect("a checksum"), f.next().expect("a second checksum"))
}

/// Checkpoints `w` (evicting it), restores it with `args` and checks its shared memory.
fn round_trip(d: &Daemon, w: &mut Workload, before: &[String], args: &[&str]) {
    let ck = d.json(&["checkpoint", "--workload", &w.name, "--json"]);
    procfs::wait_gone(w.pid, "the evicted tree to be gone");
    let mut command = vec!["restore", "--workload", &w.name, "--json"];
    command.extend(args);
    let out = d.cli(&command);
    assert!(
        out.status.success(),
        "restore {args:?} of a tree with never-written shared memory failed:\n{}\n{}",
        String::from_utf8_lossy(&out.stderr),
        d.log_tail(30)
    );
    let r: serde_json::Value = serde_json::from_slice(&out.stdout).expect("restore JSON");
    assert_eq!(r["id"], ck["id"], "{r}");
    w.restored(&r);
    let seen = w.lines().len();
    let after = sums(w, seen);
    assert_eq!(after, before, "shared memory after the restore {args:?} differs from the checkpoint's");
}

#[test]
fn never_written_shared_anonymous_memory_restores_eagerly_and_lazily() {
    skip_unless_ready!();
    let d = Daemon::start();
    let mut w = d.run("shm", &python_workload("shared_memory.py", &["marked-after-restore"]));
    expect_within(TIMEOUT, "both processes to be ready", || {
        (w.lines().iter().filter(|l| l.starts_with("ready ")).count() == 2).then_some(())
    });
    let before = sums(&w, 0);
    assert_eq!(before[0], before[1], "parent and child share the written mapping: {before:?}");

    // Neither untouched mapping is read before both restores: a read puts pages in them.
    round_trip(&d, &mut w, &before, &[]);
    round_trip(&d, &mut w, &before, &["--lazy"]);

    let seen = w.lines().len();
    procfs::signal(w.main_pid(), Signal::SIGUSR1);
    let zeros = pair(&w, seen, "zeros ");
    assert_eq!(zeros, (ZEROS_SHA256.into(), ZEROS_SHA256.into()), "never-written memory reads as zeros");
    // Still shared after two restores: the child sees what the parent wrote.
    let marked = pair(&w, seen, "marked ");
    assert_ne!(marked.0, ZEROS_SHA256, "the parent's mark is in the untouched mapping");
    assert_ne!(marked.1, ZEROS_SHA256, "the parent's mark is in the /dev/zero mapping");
    assert_eq!(pair(&w, seen, "seen "), marked, "the child no longer shares the parent's mappings");

    let checked = d.json(&["check", "--json"]);
    assert!(
        checked["problems"].as_array().is_none_or(|p| p.is_empty())
            && checked["broken"].as_array().is_none_or(|b| b.is_empty()),
        "the checkpoints should be complete: {checked}"
    );
}
