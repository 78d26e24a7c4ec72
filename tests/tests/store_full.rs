//! A store that runs out of space mid-upload: the eviction fails naming the store, the
//! workload runs on, and what the failed upload wrote is removed at once, so the next (smaller)
//! checkpoint fits.

#![forbid(unsafe_code)]

use std::time::Duration;

use stasis_tests::disk::SmallDisk;
use stasis_tests::{Daemon, expect_within, procfs, python_workload, skip_unless_ready};

#[test]
fn a_store_that_runs_full_fails_the_eviction_keeps_the_job_and_frees_its_space() {
    skip_unless_ready!();
    let d = Daemon::start();
    let disk = SmallDisk::mount(&d.store_dir(), 48);
    // 96 MiB of random memory cannot fit in 48 MiB, compressed or not.
    let w = d.run("big", &python_workload("memhog.py", &["96"]));
    expect_within(Duration::from_secs(60), "the workload to be ready", || {
        w.lines().iter().any(|l| l == "ready").then_some(())
    });

    let err = d.cli_err(&["checkpoint", "--workload", &w.name]);
    assert!(err.contains("storing checkpoint"), "the error should name the store: {err}");
    assert!(err.to_lowercase().contains("space"), "the error should say the store is full: {err}");
    assert!(procfs::running(w.pid), "the workload: {:?}", procfs::proc_state(w.pid));
    // Removed in the background, right after the failure.
    expect_within(stasis_tests::TIMEOUT, "the failed upload's packs to be removed", || {
        (disk.used_bytes() < 4 << 20).then_some(())
    });

    // The space is there again: a small checkpoint fits.
    let small = d.run("small", &python_workload("counter.py", &[]));
    small.wait_number("count ", 3);
    d.json(&["checkpoint", "--workload", &small.name, "--leave-running", "--json"]);
    procfs::kill9(w.pid);
}
