//! Store faults at each phase: S3 answering 503, or dropping connections, for pack uploads,
//! for the manifest write, and for a restore's pack reads; a slow store; the staging spill's
//! disk full; a read-only store. Each time the workload runs on (resumed) or its checkpoint is
//! durable, never neither; no partial checkpoint becomes visible; errors name the store and
//! the reason; and once the fault is gone the next try works.

#![forbid(unsafe_code)]

use std::time::Duration;

use stasis_tests::disk::SmallDisk;
use stasis_tests::http_faults::{Fault, FaultyHttp, Rule};
use stasis_tests::s3::S3Server;
use stasis_tests::{
    Daemon, DaemonOptions, TIMEOUT, Workload, expect_within, procfs, python_workload, skip_unless_ready,
};

fn checkpoints(d: &Daemon) -> usize {
    d.json(&["list", "--json"])["checkpoints"].as_array().map_or(0, Vec::len)
}

/// An eviction that must fail with an error containing each of `says`, leaving `w` running
/// and no checkpoint behind.
fn eviction_fails(d: &Daemon, w: &Workload, says: &[&str]) {
    let before = checkpoints(d);
    let err = d.cli_err(&["checkpoint", "--workload", &w.name]);
    for part in says {
        assert!(err.to_lowercase().contains(&part.to_lowercase()), "the error should say {part:?}: {err}");
    }
    assert_eq!(procfs::proc_state(w.pid).map(|s| s != 'T'), Some(true), "the workload runs on: {err}");
    let count = w.numbers("count ").len();
    expect_within(TIMEOUT, "the workload to go on counting", || {
        (w.numbers("count ").len() > count + 2).then_some(())
    });
    assert_eq!(checkpoints(d), before, "no partial checkpoint is visible");
}

#[test]
fn s3_faults_at_each_phase_leave_the_job_running_or_its_checkpoint_durable() {
    skip_unless_ready!();
    let Some(s3) = S3Server::start() else { return };
    let relay = FaultyHttp::start(s3.port);
    let d = Daemon::start_with(&s3.daemon_options_at(relay.port, "faults", &["--store-retry-secs", "2"]));
    let w = d.run("counted", &python_workload("counter.py", &[]));
    w.wait_number("count ", 3);
    let fail = |method, path, fault| relay.set(Some(Rule { method, path, fault }));

    fail("PUT", ".pack", Fault::Unavailable);
    eviction_fails(&d, &w, &["storing checkpoint", "packs/", "503"]);
    assert_eq!(
        s3.unfinished_uploads(),
        0,
        "a failed pack upload is aborted, its parts not left in the bucket"
    );
    fail("PUT", ".idx", Fault::Reset);
    eviction_fails(&d, &w, &["storing checkpoint", "packs/"]);
    fail("PUT", "/manifests/", Fault::Unavailable);
    eviction_fails(&d, &w, &["storing checkpoint", "manifests/", "503"]);
    // A store that stops answering: the request ends at --store-retry-secs (2 s here; it
    // took the HTTP client's 30 s before), then the job is resumed.
    fail("PUT", "/manifests/", Fault::Hang);
    let started = std::time::Instant::now();
    eviction_fails(&d, &w, &["storing checkpoint", "manifests/", "no answer within 2 s", "timed out"]);
    assert!(started.elapsed() < Duration::from_secs(25), "a hung store cost {:?}", started.elapsed());

    // A slow store is only slow.
    fail("PUT", "", Fault::Slow(Duration::from_millis(200)));
    let ck = d.json(&["checkpoint", "--workload", &w.name, "--json"]);
    assert_eq!(ck["durable"], true, "{ck}");
    procfs::wait_gone(w.pid, "the evicted workload to be gone");
    let counted = *w.numbers("count ").last().expect("counts");

    // Restores whose pack reads fail restore nothing, and leave the checkpoint whole.
    for fault in [Fault::Unavailable, Fault::Reset] {
        fail("GET", "/packs/", fault);
        let err = d.cli_err(&["restore", "--workload", &w.name]);
        assert!(err.contains("packs/"), "the error should name what could not be read: {err}");
        let left = procfs::in_workload_cgroup(&w.name);
        assert!(!procfs::exists(w.pid) && left.is_empty(), "nothing restored runs after {fault:?}: {left:?}");
    }
    relay.set(None);
    d.json(&["restore", "--workload", &w.name, "--json"]);
    expect_within(TIMEOUT, "the restored counter to go on", || {
        w.numbers("count ").into_iter().any(|n| n == counted + 3).then_some(())
    });
}

#[test]
fn a_full_spill_disk_fails_a_checkpoint_and_a_read_only_store_an_eviction_and_both_keep_the_job() {
    skip_unless_ready!();
    // 1 MiB of staging in memory, and the scratch space of the spill file on a 16 MiB disk:
    // a checkpoint that leaves the job running stages its pages while the job is frozen.
    let d = Daemon::start_with(&DaemonOptions {
        args: vec!["--staging-mib".into(), "1".into()],
        ..Default::default()
    });
    let spill = SmallDisk::mount(&d.dir().join("state/work"), 16);
    let big = d.run("big", &python_workload("memhog.py", &["64"]));
    expect_within(Duration::from_secs(60), "the workload to be ready", || {
        big.lines().iter().any(|l| l == "ready").then_some(())
    });
    let err = d.cli_err(&["checkpoint", "--workload", &big.name, "--leave-running"]);
    assert!(err.to_lowercase().contains("space"), "the error should say the disk is full: {err}");
    assert_eq!(procfs::proc_state(big.pid).map(|s| s != 'T'), Some(true), "the workload runs on: {err}");
    // An eviction stores its pages as CRIU sends them: it needs no spill space.
    let evicted = d.json(&["checkpoint", "--workload", &big.name, "--json"]);
    assert_eq!(evicted["durable"], true, "{evicted}");
    drop(spill);

    let store = SmallDisk::mount(&d.store_dir(), 64);
    let early = d.run("early", &python_workload("counter.py", &[]));
    early.wait_number("count ", 3);
    d.json(&["checkpoint", "--workload", &early.name, "--json"]);
    store.read_only();
    let w = d.run("counted", &python_workload("counter.py", &[]));
    w.wait_number("count ", 3);
    eviction_fails(&d, &w, &["storing checkpoint", "read-only"]);
    // A restore writes a lease first (it keeps other nodes' collections off the packs it
    // reads): from a read-only store it is refused, saying why, with nothing restored.
    let err = d.cli_err(&["restore", "--workload", &early.name]);
    assert!(err.contains("the store must be writable"), "the error says why: {err}");
    assert!(err.contains("Read-only file system"), "and what the store said: {err}");
    assert!(procfs::in_workload_cgroup(&early.name).is_empty(), "nothing restored runs: {err}");
}
