//! The S3 path, against a real S3-compatible server process on loopback (moto's server,
//! installed by scripts/test.sh into .stasis/venv): checkpoint and restore through it, an
//! incremental second checkpoint, and a store that dies: the checkpoint fails with an error
//! about the store and the workload runs on, neither stopped nor killed.

#![forbid(unsafe_code)]

use std::process::Stdio;
use std::time::Duration;

use nix::sys::signal::Signal;
use stasis_tests::http_faults::{Fault, FaultyHttp, Rule};
use stasis_tests::s3::S3Server;
use stasis_tests::{Daemon, TIMEOUT, expect_within, procfs, python_workload, skip_unless_ready};

#[test]
fn checkpoints_go_through_a_real_s3_server_and_a_dead_one_leaves_the_job_running() {
    skip_unless_ready!();
    let Some(s3) = S3Server::start() else { return };
    let d = Daemon::start_with(&s3.daemon_options("tenant-a", &["--store-retry-secs", "5"]));

    let mut w = d.run("counter", &python_workload("counter.py", &[]));
    w.wait_number("count ", 5);
    let ck = d.json(&["checkpoint", "--workload", &w.name, "--json"]);
    let at_checkpoint = w.last_number("count ").unwrap();
    procfs::wait_gone(w.pid, "the evicted counter to be gone");
    let first = ck["stats"]["bytes_uploaded"].as_u64().unwrap();
    assert!(first > 0, "{ck}");

    w.restored(&d.json(&["restore", ck["id"].as_str().unwrap(), "--json"]));
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

/// Two nodes share a bucket: node B's garbage collection (no grace period at all) comes while
/// node A is uploading a checkpoint whose packs no manifest references yet. B waits for A's
/// commit (A holds a lease in the store meanwhile) instead of deleting A's packs, and A's
/// checkpoint restores whole.
#[test]
fn a_collection_on_another_node_waits_for_an_upload_under_way() {
    skip_unless_ready!();
    let Some(s3) = S3Server::start() else { return };
    let relay = FaultyHttp::start(s3.port);
    let a = Daemon::start_with(&s3.daemon_options_at(relay.port, "shared", &[]));
    let b = Daemon::start_with(&s3.daemon_options("shared", &["--gc-grace-secs", "0"]));
    let mut w = a.run("memhog", &python_workload("memhog.py", &["96"]));
    w.wait_line_after(0, "the workload to be ready", |l| l == "ready");
    procfs::signal(w.pid, Signal::SIGUSR2);
    let (_, before) = w.wait_line_after(0, "a checksum", |l| l.starts_with("checksum "));
    // The manifest's write is held back: A's packs are in the bucket, referenced by nothing.
    relay.set(Some(Rule { method: "PUT", path: "/manifests/", fault: Fault::Slow(Duration::from_secs(5)) }));
    let evicting = a
        .command(&["checkpoint", "--workload", &w.name, "--json"])
        .stdin(Stdio::null())
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .spawn()
        .unwrap();
    expect_within(TIMEOUT, "A's packs to be in the bucket", || {
        (b.json(&["check", "--json"])["packs"].as_u64() >= Some(3)).then_some(())
    });
    let collected = b.json(&["gc", "--json"]);
    let out = evicting.wait_with_output().unwrap();
    assert!(out.status.success(), "the eviction failed: {}", String::from_utf8_lossy(&out.stderr));
    relay.set(None);
    let id =
        serde_json::from_slice::<serde_json::Value>(&out.stdout).unwrap()["id"].as_str().unwrap().to_owned();
    assert_eq!(collected["packs_deleted"], 0, "B deleted packs of A's upload: {collected}");
    procfs::wait_gone(w.pid, "the evicted workload to be gone");
    let skip = w.lines().len();
    w.restored(&a.json(&["restore", &id, "--json"]));
    procfs::signal(w.pid, Signal::SIGUSR2);
    let (_, after) = w.wait_line_after(skip, "a checksum after the restore", |l| l.starts_with("checksum "));
    assert_eq!(after, before, "memory differs after B's collection");
}
