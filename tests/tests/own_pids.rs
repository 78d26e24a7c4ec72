//! Workloads in a pid namespace of their own (`stasis run --own-pids`, under stasis-init):
//! one checkpoint restores as several independent copies beside the running original, each
//! in a namespace of its own, with its own memory; a copy is checkpointed and restored in
//! turn, lazily; a restore that would take over the running workload's name is refused; an
//! idle one is reclaimed and woken into a new namespace by a request.

#![forbid(unsafe_code)]

use std::path::PathBuf;
use std::time::Duration;

use nix::sys::signal::Signal;
use stasis_tests::{
    Daemon, TIMEOUT, Workload, expect_within, free_port, http_get, pid_of, procfs, python_workload,
    skip_unless_ready,
};

/// The pid of `pid` inside its innermost pid namespace.
fn inner_pid(pid: i32) -> Option<i32> {
    let status = std::fs::read_to_string(format!("/proc/{pid}/status")).ok()?;
    let line = status.lines().find_map(|l| l.strip_prefix("NSpid:"))?;
    line.split_whitespace().last()?.parse().ok()
}

/// Asks the tree of `pid` (memhog.py under its init, which passes the signal on) for its
/// checksum, and waits for the answer after the log's current lines.
fn checksum(log: &Workload, pid: i32) -> String {
    let skip = log.lines().len();
    procfs::signal(pid, Signal::SIGUSR2);
    log.wait_line_after(skip, "a checksum", |l| l.starts_with("checksum ")).1
}

#[test]
fn one_checkpoint_runs_as_several_independent_copies_beside_the_original() {
    skip_unless_ready!();
    let d = Daemon::start();
    let name = d.workload_name("own");
    let argv = python_workload("memhog.py", &["64"]);
    let mut args = vec!["run", "--own-pids", "--workload", &name, "--json", "--"];
    args.extend(argv.iter().map(String::as_str));
    let out = d.json(&args);
    let init = pid_of(&out);
    // Every copy writes to the one log: the file its descriptors name.
    let log =
        Workload { name: name.clone(), pid: init, log: PathBuf::from(out["log"].as_str().unwrap()), argv };
    log.wait_line_after(0, "the workload to be ready", |l| l == "ready");
    assert_eq!(inner_pid(init), Some(1), "the workload's root is the init of its own namespace");
    let original = checksum(&log, init);
    let ck = d.json(&["checkpoint", "--workload", &name, "--leave-running", "--json"]);
    let id = ck["id"].as_str().unwrap();

    let err = d.cli_err(&["restore", id]);
    assert!(err.contains("it runs already; give another copy a name of its own with --as"), "{err}");
    let copies: Vec<i32> = ["copy1", "copy2"]
        .iter()
        .map(|copy| {
            let restored = d.json(&["restore", id, "--as", &format!("{name}-{copy}"), "--json"]);
            assert_eq!(restored["workload"], format!("{name}-{copy}"), "{restored}");
            pid_of(&restored)
        })
        .collect();
    let err = d.cli_err(&["restore", id, "--as", &format!("{name}-copy1")]);
    assert!(err.contains("a running workload (or another user's) has that name"), "{err}");
    for &copy in &copies {
        assert!(copy != init && procfs::running(copy), "copy {copy} of {init}");
        assert_eq!(inner_pid(copy), Some(1), "each copy has a namespace of its own");
        assert_eq!(checksum(&log, copy), original, "copy {copy} has other memory");
    }

    // Their memory is their own: the original's changes, the copies' does not.
    let skip = log.lines().len();
    procfs::signal(init, Signal::SIGUSR1);
    log.wait_line_after(skip, "the original to rewrite its memory", |l| l == "dirtied");
    assert_ne!(checksum(&log, init), original);
    assert_eq!(checksum(&log, copies[0]), original);

    // The original goes; a copy is evicted and restored in turn (lazily), by its own name.
    procfs::kill9(init);
    expect_within(TIMEOUT, "the original's namespace to be gone", || (!procfs::exists(init)).then_some(()));
    let copy1 = format!("{name}-copy1");
    d.json(&["checkpoint", "--workload", &copy1, "--json"]);
    expect_within(TIMEOUT, "the evicted copy to be gone", || (!procfs::exists(copies[0])).then_some(()));
    // Lazily: it runs at once in a new namespace, its memory arriving as it is touched.
    let restored = d.json(&["restore", "--workload", &copy1, "--lazy", "--json"]);
    assert_eq!(restored["stats"]["lazy"], true, "{restored}");
    let again = pid_of(&restored);
    assert_eq!(inner_pid(again), Some(1), "{restored}");
    assert_eq!(checksum(&log, again), original);
    assert!(procfs::running(copies[1]), "the other copy runs on");
    for pid in [again, copies[1]] {
        procfs::kill9(pid);
    }
}

/// Idle reclaim of a workload with its own pid namespace: the wake is a lazy restore into a
/// new namespace, and a plain HTTP request gets its answer from the woken server.
#[test]
fn an_idle_server_with_its_own_pids_is_reclaimed_and_woken_by_a_request() {
    skip_unless_ready!();
    let d = Daemon::start();
    let name = d.workload_name("own-web");
    let port = free_port();
    let mut args = vec!["run", "--own-pids", "--workload", &name, "--idle-after", "2s", "--json", "--"];
    let argv = python_workload("http_counter.py", &[&port.to_string(), "32"]);
    args.extend(argv.iter().map(String::as_str));
    let init = pid_of(&d.json(&args));
    let first = expect_within(Duration::from_secs(60), "the server to answer", || http_get(port).ok());
    expect_within(Duration::from_secs(60), "the workload to be reclaimed", || {
        let w = d.workloads().into_iter().find(|w| w["name"] == name.as_str())?;
        (w["state"] == "reclaimed" && !procfs::exists(init)).then_some(())
    });
    let answer = http_get(port).expect("the request that wakes the server");
    assert_eq!(answer, first.replace("hits 1", "hits 2"), "the counter and the memory go on");
    let w = d.workloads().into_iter().find(|w| w["name"] == name.as_str()).unwrap();
    let woken = w["pid"].as_i64().unwrap() as i32;
    assert_eq!((w["state"].as_str(), inner_pid(woken)), (Some("running"), Some(1)), "{w}");
    procfs::kill9(woken);
}
