//! Two stasisd on one machine (each with its own state directory) keep their workloads apart:
//! a workload name used by both gets a cgroup of each daemon's own, and evicting one daemon's
//! workload leaves the other's running.

#![forbid(unsafe_code)]

use stasis_tests::{Daemon, pid_of, procfs, python_workload, skip_unless_ready};

#[test]
fn two_daemons_with_a_workload_of_the_same_name_keep_them_apart() {
    skip_unless_ready!();
    let (a, b) = (Daemon::start(), Daemon::start());
    let name = format!("shared-{}", std::process::id());
    let argv = python_workload("counter.py", &[]);
    let run = |d: &Daemon| {
        let mut args = vec!["run", "--workload", &name, "--json", "--"];
        args.extend(argv.iter().map(String::as_str));
        pid_of(&d.json(&args))
    };
    let (pa, pb) = (run(&a), run(&b));
    let (ca, cb) = (procfs::cgroup(pa).expect("cgroup of a"), procfs::cgroup(pb).expect("cgroup of b"));
    assert_ne!(ca, cb, "the two daemons' workloads share a cgroup");
    assert!(ca.ends_with(&format!("/{name}")) && cb.ends_with(&format!("/{name}")), "{ca} {cb}");

    a.json(&["checkpoint", "--workload", &name, "--json"]);
    procfs::wait_gone(pa, "a's workload to be evicted");
    assert!(procfs::running(pb), "b's workload should run on: {:?}", procfs::proc_state(pb));
    procfs::kill9(pb);
}
