//! Workloads in a pid namespace of their own (what `stasis run` starts, under stasis-init):
//! one checkpoint restores as several independent copies beside the running original, each
//! in a namespace of its own, with its own memory, log and cgroup; a copy is checkpointed and
//! restored in turn, lazily; a restore that would take over the running workload's name is
//! refused. (Idle reclaim of such workloads: `idle_reclaim.rs`.)

#![forbid(unsafe_code)]

use nix::sys::signal::Signal;
use stasis_tests::{
    Daemon, TIMEOUT, Workload, expect_within, pid_of, procfs, python_workload, skip_unless_ready,
};

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
    let mut args = vec!["run", "--workload", &name, "--json", "--"];
    args.extend(argv.iter().map(String::as_str));
    let init = pid_of(&d.json(&args));
    let log = d.known(&name, &argv);
    log.wait_line_after(0, "the workload to be ready", |l| l == "ready");
    assert_eq!(procfs::inner(init), 1, "the workload's root is the init of its own namespace");
    let original = checksum(&log, init);
    let ck = d.json(&["checkpoint", "--workload", &name, "--leave-running", "--json"]);
    let id = ck["id"].as_str().unwrap();

    let err = d.cli_err(&["restore", id]);
    assert!(err.contains("it runs already; give another copy a name of its own with --as"), "{err}");
    let copies: Vec<Workload> = ["copy1", "copy2"]
        .iter()
        .map(|copy| {
            let restored = d.json(&["restore", id, "--as", &format!("{name}-{copy}"), "--json"]);
            assert_eq!(restored["workload"], format!("{name}-{copy}"), "{restored}");
            d.known(&format!("{name}-{copy}"), &argv)
        })
        .collect();
    let err = d.cli_err(&["restore", id, "--as", &format!("{name}-copy1")]);
    assert!(err.contains("a running workload (or another user's) has that name"), "{err}");
    let original_cgroup = procfs::cgroup(init).expect("the original's cgroup");
    let quiet = log.lines().len();
    for copy in &copies {
        let pid = copy.pid;
        assert!(pid != init && procfs::running(pid), "copy {pid} of {init}");
        assert_eq!(procfs::inner(pid), 1, "each copy has a namespace of its own");
        assert_eq!(checksum(copy, pid), original, "copy {pid} has other memory");
        // Its output goes to a log of its own, and it sits in a cgroup of its own.
        assert_ne!(copy.log, log.log);
        let cgroup = procfs::cgroup(pid).expect("the copy's cgroup");
        assert!(cgroup.ends_with(&format!("/{}", copy.name)) && cgroup != original_cgroup, "{cgroup}");
    }
    assert_eq!(log.lines().len(), quiet, "the copies wrote into the original's log");

    // Their memory is their own: the original's changes, the copies' does not.
    let skip = log.lines().len();
    procfs::signal(init, Signal::SIGUSR1);
    log.wait_line_after(skip, "the original to rewrite its memory", |l| l == "dirtied");
    assert_ne!(checksum(&log, init), original);
    assert_eq!(checksum(&copies[0], copies[0].pid), original);

    // The original goes; a copy is evicted and restored in turn (lazily), by its own name.
    procfs::kill9(init);
    procfs::wait_gone(init, "the original's namespace to be gone");
    let copy1 = format!("{name}-copy1");
    d.json(&["checkpoint", "--workload", &copy1, "--json"]);
    expect_within(TIMEOUT, "the evicted copy to be gone", || (!procfs::exists(copies[0].pid)).then_some(()));
    // Lazily: it runs at once in a new namespace, its memory arriving as it is touched.
    let restored = d.json(&["restore", "--workload", &copy1, "--lazy", "--json"]);
    assert_eq!(restored["stats"]["lazy"], true, "{restored}");
    let again = pid_of(&restored);
    assert_eq!(procfs::inner(again), 1, "{restored}");
    assert_eq!(checksum(&copies[0], again), original);
    assert!(procfs::running(copies[1].pid), "the other copy runs on");
    for pid in [again, copies[1].pid] {
        procfs::kill9(pid);
    }
}

/// `stasis run --host-pids`: the tree has stasisd's pid namespace, so a restore brings back
/// the very pids it had, and a second copy is refused.
#[test]
fn a_workload_run_with_host_pids_comes_back_with_its_pids_and_only_once() {
    skip_unless_ready!();
    let d = Daemon::start();
    let name = d.workload_name("host");
    let argv = python_workload("counter.py", &[]);
    let mut args = vec!["run", "--host-pids", "--workload", &name, "--json", "--"];
    args.extend(argv.iter().map(String::as_str));
    let pid = pid_of(&d.json(&args));
    assert_eq!(procfs::ns_pids(pid).len(), 1, "no pid namespace of its own");
    let mut w = d.known(&name, &argv);
    w.wait_number("count ", 3);
    let ck = d.json(&["checkpoint", "--workload", &name, "--leave-running", "--json"]);
    let at_checkpoint = w.last_number("count ").unwrap();
    let id = ck["id"].as_str().unwrap();
    let err = d.cli_err(&["restore", id, "--as", &format!("{name}-copy")]);
    assert!(err.contains("it keeps its pids"), "{err}");

    w.wait_number("count ", at_checkpoint + 10);
    procfs::kill9(pid);
    procfs::wait_gone(pid, "the workload to be gone");
    let skip = w.lines().len();
    w.restored(&d.json(&["restore", id, "--json"]));
    assert_eq!(w.pid, pid, "the same pid again");
    w.wait_line_after(skip, "a count after the restore", |l| l.starts_with("count "));
    let after = stasis_tests::numbered(&w.lines()[skip..], "count ");
    assert!(after[0] <= at_checkpoint + 1, "it goes on from the checkpoint ({at_checkpoint}): {after:?}");
}
