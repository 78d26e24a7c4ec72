//! Lazy ("hot") restore: the tree runs before its memory has arrived, its memory is correct
//! once resident, and a store that stops answering mid-way, or answers with damaged data,
//! ends with the tree killed and an error that says why, never a tree running on memory that
//! never arrived.

#![forbid(unsafe_code)]

use std::io::{BufRead, BufReader};
use std::process::Stdio;
use std::time::{Duration, Instant};

use nix::sys::signal::Signal;
use stasis_tests::http_faults::{Fault, FaultyHttp, Rule};
use stasis_tests::s3::S3Server;
use stasis_tests::{Daemon, TIMEOUT, expect_within, memtest, procfs, python_workload, skip_unless_ready};

#[test]
fn lazily_restored_threads_go_on_and_memory_matches_once_resident() {
    skip_unless_ready!();
    let d = Daemon::start();
    // 4 threads with 48 MiB each, rewriting their memory while they run.
    let mut w = d.run("memtest", &memtest::argv(4, 48));
    memtest::wait_ready(&w);
    let tids = w.threads();
    let paused = memtest::pause(&w);

    let ck = d.json(&["checkpoint", "--workload", &w.name, "--json"]);
    procfs::wait_gone(w.pid, "the evicted tree to be gone");

    let r = d.json(&["restore", "--workload", &w.name, "--lazy", "--json"]);
    assert_eq!(r["id"], ck["id"], "{r}");
    w.restored(&r);
    let stats = &r["stats"];
    let (first_run, resident) =
        (stats["first_run_ms"].as_u64().unwrap(), stats["resident_ms"].as_u64().unwrap());
    assert_eq!(stats["lazy"], true, "{r}");
    assert!(first_run > 0 && first_run <= resident, "first run {first_run} ms, resident {resident} ms: {r}");
    assert!(stats["bytes_fetched"].as_u64().unwrap() > 0, "{r}");
    assert_eq!(w.threads(), tids, "the restored process must have the same threads");

    assert_eq!(memtest::checksum(&w), paused.checksum, "memory after the lazy restore differs");

    // The threads resume and keep working on the restored memory.
    memtest::run_past(&w, paused.iterations);
    assert!(procfs::running(w.pid));
}

#[test]
fn lazy_restore_without_waiting_returns_while_memory_arrives_and_ends_resident() {
    skip_unless_ready!();
    let d = Daemon::start();
    let mut w = d.run("memhog", &python_workload("memhog.py", &["96"]));
    w.wait_line_after(0, "memhog `ready`", |l| l == "ready");
    procfs::signal(w.pid, Signal::SIGUSR2);
    let (_, before) = w.wait_line_after(0, "`checksum ...`", |l| l.starts_with("checksum "));
    // A first checkpoint, then memory written since, then the one restored: its new chunks
    // are fetched first.
    d.json(&["checkpoint", "--workload", &w.name, "--leave-running", "--json"]);
    let seen = w.lines().len();
    procfs::signal(w.pid, Signal::SIGUSR1);
    w.wait_line_after(seen, "`dirtied`", |l| l == "dirtied");
    let seen = w.lines().len();
    procfs::signal(w.pid, Signal::SIGUSR2);
    let (_, dirtied) = w.wait_line_after(seen, "`checksum ...`", |l| l.starts_with("checksum "));
    assert_ne!(dirtied, before);
    d.json(&["checkpoint", "--workload", &w.name, "--json"]);
    procfs::wait_gone(w.pid, "the evicted tree to be gone");

    let r = d.json(&["restore", "--workload", &w.name, "--lazy", "--no-wait", "--json"]);
    assert_eq!(r["stats"]["resident_ms"], 0, "an answer before residency: {r}");
    w.restored(&r);
    assert!(procfs::alive(w.pid), "the tree runs when the answer comes");
    let seen = w.lines().len();
    procfs::signal(w.pid, Signal::SIGUSR2);
    let (_, after) =
        w.wait_line_after(seen, "`checksum ...` after the restore", |l| l.starts_with("checksum "));
    assert_eq!(after, dirtied, "memory after the lazy restore differs from the checkpoint");
}

/// Starts a lazy restore of `argv` (holding over 100 MiB) evicted to a moto S3 store (slow
/// enough that memory is still arriving), reached on `port` (its own, or a relay's), and
/// returns once the tree runs: the daemon, the workload's pid, the running `stasis restore`
/// and its stderr.
fn lazy_restore_over_s3(
    s3: &S3Server,
    port: u16,
    argv: &[String],
) -> (Daemon, i32, std::process::Child, BufReader<std::process::ChildStderr>) {
    // A small cache, so the prefetcher cannot have everything before the test interferes.
    // A store request may take 10 s (moto is slow on a busy machine: 8 MiB parts take seconds).
    let args = ["--store-retry-secs", "10", "--lazy-timeout-secs", "3", "--lazy-cache-mib", "8"];
    let d = Daemon::start_with(&s3.daemon_options_at(port, "lazy", &args));
    let w = d.run("lazy", argv);
    w.wait_line_after(0, "the workload's `ready`", |l| l == "ready");
    d.json(&["checkpoint", "--workload", &w.name, "--json"]);
    procfs::wait_gone(w.pid, "the evicted tree to be gone");
    let mut restore = d
        .command(&["restore", "--workload", &w.name, "--lazy"])
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .spawn()
        .expect("stasis restore");
    let mut stderr = BufReader::new(restore.stderr.take().unwrap());
    let mut said = String::new();
    while !said.contains("running as pid") {
        let mut line = String::new();
        if stderr.read_line(&mut line).unwrap() == 0 {
            panic!("stasis restore ended before the tree ran: {said}");
        }
        said.push_str(&line);
    }
    let pid = said
        .split("running as pid ")
        .nth(1)
        .and_then(|rest| rest.split(|c: char| !c.is_ascii_digit()).next()?.parse().ok());
    (d, pid.unwrap_or_else(|| panic!("no pid in {said:?}")), restore, stderr)
}

/// Waits for the restore to end; returns whether it succeeded, and the rest of its stderr.
fn outcome(
    mut restore: std::process::Child,
    mut stderr: BufReader<std::process::ChildStderr>,
) -> (bool, String) {
    let status = restore.wait().unwrap();
    let mut rest = String::new();
    std::io::Read::read_to_string(&mut stderr, &mut rest).unwrap();
    (status.success(), rest)
}

#[test]
fn memory_a_lazily_restored_process_forks_moves_or_drops_meanwhile_is_right() {
    skip_unless_ready!();
    let Some(s3) = S3Server::start() else { return };
    let argv = python_workload("fork_churn.py", &["120", "40"]);
    let d = Daemon::start_with(&s3.daemon_options("churn", &["--lazy-cache-mib", "8"]));
    let mut w = d.run("churn", &argv);
    w.wait_line_after(0, "the workload's `ready`", |l| l == "ready");
    procfs::signal(w.pid, Signal::SIGUSR2);
    let (_, sums) = w.wait_line_after(0, "`sums ...`", |l| l.starts_with("sums "));
    let sums: Vec<&str> = sums.split_whitespace().skip(1).collect();
    d.json(&["checkpoint", "--workload", &w.name, "--json"]);
    procfs::wait_gone(w.pid, "the evicted tree to be gone");

    // Restored lazily from a slow store with a small cache: memory is still arriving when
    // the process forks, grows a buffer (mremap) and frees one (munmap).
    let r = d.json(&["restore", "--workload", &w.name, "--lazy", "--no-wait", "--json"]);
    w.restored(&r);
    let seen = w.lines().len();
    procfs::signal(w.pid, Signal::SIGUSR1);
    let (_, child) = w.wait_line_after(seen, "the child's `child ...`", |l| l.starts_with("child "));
    let (_, parent) = w.wait_line_after(seen, "the parent's `parent ...`", |l| l.starts_with("parent "));
    assert_eq!(child, format!("child {}", sums[0]), "the forked child's copy of the memory");
    assert_eq!(parent, format!("parent {} {}", sums[0], sums[1]), "the parent's memory, moved by mremap");
    assert!(
        d.log_tail(400).contains("a restored process forked while its memory was arriving"),
        "the fork came while memory was arriving (else this test proves nothing):\n{}",
        d.log_tail(40)
    );
    expect_within(TIMEOUT, "the restore to be resident", || {
        let status = d.workloads().into_iter().find(|s| s["name"] == w.name.as_str())?;
        status["last_error"].as_str().is_none_or(str::is_empty).then_some(())?;
        d.log_tail(100).contains("restored memory resident").then_some(())
    });
    let seen = w.lines().len();
    procfs::signal(w.pid, Signal::SIGUSR2);
    let (_, after) = w.wait_line_after(seen, "`sums ...` once resident", |l| l.starts_with("sums "));
    assert_eq!(after.split_whitespace().nth(1), Some(sums[0]), "big, once every page is in");
}

#[test]
fn a_store_that_stops_answering_gets_the_lazily_restored_tree_killed_with_the_reason() {
    skip_unless_ready!();
    let Some(s3) = S3Server::start() else { return };
    let (d, pid, restore, stderr) =
        lazy_restore_over_s3(&s3, s3.port, &python_workload("memhog.py", &["160"]));
    // The store hangs: connections are accepted, nothing is answered.
    procfs::signal(s3.pid(), Signal::SIGSTOP);
    let stopped = Instant::now();
    let (success, rest) = outcome(restore, stderr);
    procfs::signal(s3.pid(), Signal::SIGCONT);

    assert!(!success, "the restore must fail: {rest}");
    assert!(rest.contains("was killed"), "the error says the tree was killed: {rest}");
    assert!(rest.contains("did not deliver memory"), "the error says why: {rest}");
    assert!(stopped.elapsed() < Duration::from_secs(30), "ended after {:?}", stopped.elapsed());
    procfs::wait_gone(pid, "the restored tree to be gone");
    // A caller that did not wait (--no-wait) finds the reason in status.
    let workloads = d.workloads();
    let failed = workloads.iter().find(|w| w["pid"] == pid).expect("the workload in status");
    let why = failed["last_error"].as_str().unwrap_or_default();
    assert!(why.contains("did not deliver memory"), "status should say why the restore failed: {failed}");
}

#[test]
fn memory_damaged_on_its_way_from_the_store_gets_the_tree_killed_not_run_on_it() {
    skip_unless_ready!();
    let Some(s3) = S3Server::start() else { return };
    let relay = FaultyHttp::start(s3.port);
    let (d, pid, restore, stderr) =
        lazy_restore_over_s3(&s3, relay.port, &python_workload("memhog.py", &["160"]));
    assert!(
        d.log_tail(400).contains("lazy-restore guard holds the tree's userfaultfds"),
        "a guard holds the tree's userfaultfds, so its faults wait instead of reading zeros:\n{}",
        d.log_tail(40)
    );
    // From now on every pack read comes back damaged.
    relay.set(Some(Rule { method: "GET", path: "/packs/", fault: Fault::Corrupt }));
    let (success, rest) = outcome(restore, stderr);

    assert!(!success, "the restore must fail: {rest}");
    assert!(
        rest.contains("was killed") && rest.contains("is corrupted"),
        "the error says what happened: {rest}"
    );
    procfs::wait_gone(pid, "the restored tree to be gone");
}

#[test]
fn a_tree_lazily_restored_by_a_stasisd_that_crashes_is_killed_by_its_guard() {
    skip_unless_ready!();
    let Some(s3) = S3Server::start() else { return };
    // Threads that keep computing on their memory: without the guard they would run on,
    // on zeros where memory had not arrived, instead of crashing.
    let (mut d, pid, restore, stderr) = lazy_restore_over_s3(&s3, s3.port, &memtest::argv(2, 80));
    // stasisd dies mid-way: its page server goes with it, so the memory can no longer arrive.
    d.kill9_and_restart();
    let (success, _) = outcome(restore, stderr);
    assert!(!success, "the restore cannot have succeeded");
    procfs::wait_gone(pid, "the guard to kill the restored tree");
}
