//! Periodic checkpoints: a workload started with `--checkpoint-every` is checkpointed (left
//! running, incrementally) at that interval while it counts on; stopping them stops them; and
//! the newest one restores the job after it is lost.

#![forbid(unsafe_code)]

use std::time::Duration;

use stasis_tests::{Daemon, expect_within, pid_of, procfs, python_workload, skip_unless_ready};

fn ids(d: &Daemon, name: &str) -> Vec<String> {
    let listed = d.json(&["list", "--workload", name, "--json"]);
    listed["checkpoints"].as_array().unwrap().iter().map(|c| c["id"].as_str().unwrap().to_owned()).collect()
}

#[test]
fn a_workload_is_checkpointed_every_interval_while_it_runs() {
    skip_unless_ready!();
    let d = Daemon::start();
    let name = d.workload_name("periodic");
    let mut args = vec!["run", "--workload", &name, "--checkpoint-every", "2s", "--json", "--"];
    let argv = python_workload("counter.py", &[]);
    args.extend(argv.iter().map(String::as_str));
    let pid = pid_of(&d.json(&args));

    let taken = expect_within(Duration::from_secs(30), "three periodic checkpoints", || {
        let ids = ids(&d, &name);
        (ids.len() >= 3).then_some(ids)
    });
    assert!(procfs::running(pid), "left running: {:?}", procfs::proc_state(pid));
    let status = d.workload(&name);
    assert_eq!(status["checkpoint_every_ms"], 2000, "{status}");

    d.ok(&["periodic", &name, "--off"]);
    std::thread::sleep(Duration::from_secs(1));
    // (Retention keeps the newest three: compare which they are, not how many.)
    let stopped = ids(&d, &name);
    std::thread::sleep(Duration::from_secs(5));
    assert_eq!(ids(&d, &name), stopped, "no more after --off (the first ones: {taken:?})");

    // The job is lost; its newest periodic checkpoint brings it back.
    procfs::kill9(pid);
    procfs::wait_gone(pid, "the job to be gone");
    let restored = pid_of(&d.json(&["restore", "--workload", &name, "--json"]));
    assert!(procfs::running(restored) && procfs::is_namespace_init(restored));
}
