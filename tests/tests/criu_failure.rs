//! CRIU failing in the middle of a dump, after the tree was frozen: the checkpoint fails with
//! CRIU's own explanation, and the workload is left running as if nothing had happened. And
//! what CRIU is known not to dump (io_uring, memfd_secret memory, a vfork()ed child) refused
//! before anything is frozen, naming the process and what it holds.

#![forbid(unsafe_code)]

use stasis_tests::{
    Daemon, DaemonOptions, Workload, expect_within, procfs, python_workload, skip_unless_ready,
};

#[test]
fn failed_dump_leaves_the_workload_running_and_stores_nothing() {
    skip_unless_ready!();
    // CRIU's own fault injection: its dump fails as it starts dumping pages, with the tree
    // frozen and CRIU's code inside each process.
    let d = Daemon::start_with(&DaemonOptions {
        env: vec![("CRIU_FAULT".into(), "3".into())],
        ..Default::default()
    });
    let w = d.run("counter", &python_workload("counter.py", &[]));
    w.wait_number("count ", 5);

    let out = d.cli(&["checkpoint", "--workload", &w.name, "--json"]);
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert_eq!(
        out.status.code(),
        Some(1),
        "a checkpoint whose CRIU fails should fail; stdout:\n{}\nstderr:\n{stderr}",
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

/// Starts workload script `script` and waits for its first line: `None` (the test is
/// skipped, saying why) when the line says this kernel refused what it needs.
fn start_holding(d: &Daemon, script: &str, first: &str) -> Option<Workload> {
    let w = d.run(script.trim_end_matches(".py"), &python_workload(script, &[]));
    let line = expect_within(stasis_tests::TIMEOUT, &format!("{script} to start"), || {
        w.lines().into_iter().find(|l| l.starts_with(first) || l.contains("failed"))
    });
    if line.contains("failed") {
        eprintln!("skipping: {line}");
        return None;
    }
    Some(w)
}

/// Checks that a checkpoint of `w` is refused before anything was frozen, with an error naming
/// `process` and each of `what`, and that `w` ran on untouched.
fn assert_refused_up_front(d: &Daemon, w: &Workload, process: i32, what: &[&str]) {
    let err = d.cli_err(&["checkpoint", "--workload", &w.name]);
    assert!(err.contains(&format!("process {process} (")), "the error names the process: {err}");
    for what in what {
        assert!(err.contains(what), "the error says {what:?}: {err}");
    }
    assert!(err.contains("nothing was touched"), "{err}");
    assert!(!err.contains("CRIU dump failed"), "refused before CRIU ran: {err}");
    assert!(!d.log_tail(400).contains("dumping"), "nothing was dumped:\n{}", d.log_tail(400));
    assert!(
        procfs::running(process) || procfs::proc_state(process) == Some('D'),
        "{:?}",
        procfs::proc_state(process)
    );
    assert_eq!(procfs::tracer(w.pid), Some(0));
}

#[test]
fn a_tree_holding_an_io_uring_is_refused_before_it_is_frozen() {
    skip_unless_ready!();
    let d = Daemon::start();
    let Some(w) = start_holding(&d, "io_uring.py", "io_uring fd ") else { return };
    w.wait_number("count ", 3);
    assert_refused_up_front(&d, &w, w.main_pid(), &["an io_uring instance (descriptor "]);
    let before = w.last_number("count ").unwrap();
    w.wait_number("count ", before + 5);
}

#[test]
fn a_tree_holding_secret_memory_is_refused_before_it_is_frozen() {
    skip_unless_ready!();
    let d = Daemon::start();
    let Some(w) = start_holding(&d, "secret_memory.py", "count ") else { return };
    assert_refused_up_front(&d, &w, w.main_pid(), &["secret memory (memfd_secret)"]);
    let before = w.last_number("count ").unwrap();
    w.wait_number("count ", before + 5);
}

#[test]
fn a_vforked_child_is_refused_before_the_tree_is_frozen() {
    skip_unless_ready!();
    let d = Daemon::start();
    let Some(w) = start_holding(&d, "vfork_child.py", "vforked") else { return };
    let parent = w.main_pid();
    let child = expect_within(stasis_tests::TIMEOUT, "the vforked child", || {
        procfs::children(parent).first().copied()
    });
    assert_refused_up_front(&d, &w, child, &["shares its address space with its parent", "vfork"]);
}
