//! CRIU failing in the middle of a dump, after the tree was frozen: the checkpoint fails with
//! CRIU's own explanation, and the workload is left running as if nothing had happened.

#![forbid(unsafe_code)]

use stasis_tests::{Daemon, expect_within, procfs, python_workload, skip_unless_ready};

#[test]
fn failed_dump_leaves_the_workload_running_and_stores_nothing() {
    skip_unless_ready!();
    let d = Daemon::start();
    let w = d.run("io-uring", &python_workload("io_uring.py", &[]));
    expect_within(stasis_tests::TIMEOUT, "io_uring.py to start", || {
        let lines = w.lines();
        (lines.iter().any(|l| l.starts_with("count ")) || lines.iter().any(|l| l.contains("failed")))
            .then_some(())
    });
    if let Some(line) = w.lines().iter().find(|l| l.contains("io_uring_setup failed")) {
        eprintln!("skipping failed_dump_leaves_the_workload_running_and_stores_nothing: {line}");
        return;
    }
    w.wait_number("count ", 5);

    let out = d.cli(&["checkpoint", "--workload", &w.name, "--json"]);
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert_eq!(
        out.status.code(),
        Some(1),
        "a checkpoint of a process holding an io_uring should fail (CRIU 4.1 cannot dump \
         io_uring); stdout:\n{}\nstderr:\n{stderr}",
        String::from_utf8_lossy(&out.stdout)
    );
    assert!(stderr.starts_with("error: "), "stderr: {stderr}");
    assert!(stderr.contains("CRIU dump failed"), "the error should say CRIU's dump failed:\n{stderr}");
    assert!(
        stderr.contains("Error (criu/"),
        "the error should carry the relevant lines of CRIU's log:\n{stderr}"
    );
    let after_failure = w.last_number("count ").unwrap();

    assert!(
        procfs::running(w.pid),
        "the workload should be running after the failed dump, state {:?}",
        procfs::proc_state(w.pid)
    );
    assert_eq!(procfs::tracer(w.pid), Some(0), "the workload is still traced after the failed dump");
    // It counts on for a second (20 counts at 50 ms) and is still running then.
    w.wait_number("count ", after_failure + 20);
    assert!(procfs::running(w.pid), "state after the failed dump: {:?}", procfs::proc_state(w.pid));

    let listed = d.json(&["list", "--json"]);
    let checkpoints = listed["checkpoints"].as_array().expect("checkpoints array");
    assert!(checkpoints.is_empty(), "a failed checkpoint must not be listed: {listed}");
    let listed = d.json(&["list", "--workload", &w.name, "--json"]);
    assert_eq!(listed["checkpoints"].as_array().map(Vec::len), Some(0), "{listed}");

    let status = d.workloads();
    let entry = status.iter().find(|s| s["name"] == w.name.as_str()).expect("workload in status");
    assert_eq!(entry["running"], true, "status after the failed dump: {entry}");
    assert_eq!(entry["pid"], w.pid, "status after the failed dump: {entry}");
}
