//! The S3 path, against a real S3-compatible server process on loopback (moto's server,
//! installed by scripts/test.sh into .stasis/venv): checkpoint and restore through it, an
//! incremental second checkpoint, and a store that dies: the checkpoint fails with an error
//! about the store and the workload runs on, neither stopped nor killed.

#![forbid(unsafe_code)]

use stasis_tests::s3::S3Server;
use stasis_tests::{Daemon, TIMEOUT, expect_within, procfs, python_workload, skip_unless_ready};

#[test]
fn checkpoints_go_through_a_real_s3_server_and_a_dead_one_leaves_the_job_running() {
    skip_unless_ready!();
    let Some(s3) = S3Server::start() else { return };
    let d = Daemon::start_with(&s3.daemon_options("tenant-a", &["--store-retry-secs", "2"]));

    let w = d.run("counter", &python_workload("counter.py", &[]));
    w.wait_number("count ", 5);
    let ck = d.json(&["checkpoint", "--workload", &w.name, "--json"]);
    let at_checkpoint = w.last_number("count ").unwrap();
    expect_within(TIMEOUT, "the evicted counter to be gone", || (!procfs::exists(w.pid)).then_some(()));
    let first = ck["stats"]["bytes_uploaded"].as_u64().unwrap();
    assert!(first > 0, "{ck}");

    d.json(&["restore", ck["id"].as_str().unwrap(), "--json"]);
    let resumed = w.wait_number("count ", at_checkpoint + 1);
    assert!(resumed <= at_checkpoint + 3, "counting resumed from {at_checkpoint}, not elsewhere: {resumed}");
    let again = d.json(&["checkpoint", "--workload", &w.name, "--leave-running", "--json"]);
    let second = again["stats"]["bytes_uploaded"].as_u64().unwrap();
    assert!(second * 2 < first, "the second checkpoint over S3 is incremental: {second} vs {first}");

    // The store dies while the job runs; an evicting checkpoint must fail and resume the job.
    drop(s3);
    let err = d.cli_err(&["checkpoint", "--workload", &w.name, "--json"]);
    assert!(err.contains("storing checkpoint"), "the error names the store failure: {err}");
    assert!(
        procfs::running(w.pid),
        "the workload was killed or left stopped: state {:?}",
        procfs::proc_state(w.pid)
    );
    // It counts on for half a second (10 counts at 50 ms), not stopped.
    let before = w.last_number("count ").unwrap();
    w.wait_number("count ", before + 10);
    assert_ne!(procfs::proc_state(w.pid), Some('T'));
}
