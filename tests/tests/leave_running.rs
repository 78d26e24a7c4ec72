//! `checkpoint --leave-running`: the workload goes on undisturbed, and the checkpoint restores
//! the state it had at checkpoint time, not the state it has later.

#![forbid(unsafe_code)]

use stasis_tests::{Daemon, procfs, python_workload, skip_unless_ready};

#[test]
fn leave_running_keeps_the_original_going_and_restores_the_checkpointed_state() {
    skip_unless_ready!();
    let d = Daemon::start();
    let mut w = d.run("counter", &python_workload("counter.py", &[]));
    let started = w.wait_number("count ", 10);

    let ck = d.json(&["checkpoint", "--workload", &w.name, "--leave-running", "--json"]);
    // Every count the checkpointed state can hold: from what was printed before the
    // checkpoint began to what was printed when it returned.
    let at_return = w.last_number("count ").unwrap();
    assert_eq!(ck["left_running"], true, "checkpoint result: {ck}");
    assert_eq!(ck["pid"], w.pid, "checkpoint result: {ck}");
    let id = ck["id"].as_str().expect("checkpoint id").to_owned();

    assert!(
        procfs::running(w.pid),
        "the original should be running after checkpoint --leave-running, state {:?}",
        procfs::proc_state(w.pid)
    );
    assert_eq!(procfs::tracer(w.pid), Some(0), "the original is still traced after the checkpoint");
    // The original counts on for a second (20 counts at 50 ms) past the checkpoint.
    w.wait_number("count ", at_return + 20);
    assert!(procfs::running(w.pid), "state of the original: {:?}", procfs::proc_state(w.pid));

    procfs::kill9(w.pid);
    procfs::wait_gone(w.pid, "the killed original to be reaped");
    let at_kill = w.last_number("count ").unwrap();
    let before = w.lines().len();

    let r = d.json(&["restore", &id, "--json"]);
    assert_eq!(r["id"], id.as_str(), "restore result: {r}");
    w.restored(&r);
    w.wait_number("count ", at_kill + 5);
    let after = stasis_tests::numbered(&w.lines()[before..], "count ");
    let first = after[0];
    assert!(
        (started..=at_return + 1).contains(&first),
        "the restored counter should continue from its checkpoint ({started}..={at_return}), \
         not from where the original was killed ({at_kill}); it printed {after:?}"
    );
    for pair in after.windows(2) {
        assert_eq!(pair[1], pair[0] + 1, "counts after the restore: {after:?}");
    }
}
