//! A CRIU too old for this kernel's network sockets (Debian 13's 4.1.1 on a kernel from 6.16 on):
//! stasisd still starts, says so in `status`, refuses to checkpoint a tree holding a TCP
//! listener before freezing it, with the reason, and still checkpoints socket-free trees.
//! `scripts/test.sh` installs that CRIU under `.stasis/criu-4.1`.

#![forbid(unsafe_code)]

use std::path::Path;

use stasis_tests::{Daemon, DaemonOptions, free_port, procfs, python_workload, skip_unless_ready};

fn kernel_refuses_old_criu() -> bool {
    let release = std::fs::read_to_string("/proc/sys/kernel/osrelease").expect("kernel release");
    let mut parts =
        release.trim().split(|c: char| !c.is_ascii_digit()).map(|p| p.parse::<u32>().unwrap_or(0));
    (parts.next().unwrap_or(0), parts.next().unwrap_or(0)) >= (6, 16)
}

#[test]
fn an_old_criu_is_reported_and_trees_with_network_sockets_are_refused_before_freezing() {
    skip_unless_ready!();
    if !kernel_refuses_old_criu() {
        eprintln!("skipping: this kernel (before 6.16) lets CRIU 4.1 dump inet sockets");
        return;
    }
    let old = Path::new(env!("CARGO_MANIFEST_DIR")).join("../.stasis/criu-4.1/bin/criu");
    assert!(
        old.exists(),
        "{} is missing: run `STASIS_CRIU_SUITE=trixie scripts/setup-criu.sh .stasis/criu-4.1` \
         (scripts/test.sh does)",
        old.display()
    );
    let criu = old.to_string_lossy().into_owned();
    let d = Daemon::start_with(&DaemonOptions { args: vec!["--criu".into(), criu], ..Default::default() });
    let status = d.json(&["status", "--json"]);
    let support = status["socket_support"].as_str().unwrap_or_default();
    assert!(support.contains("CRIU 4.1.1 cannot dump network"), "status should say why: {status}");

    let port = free_port().to_string();
    let w = d.run("old-criu-net", &python_workload("net.py", &["--http", &port]));
    w.wait_number("tick ", 5);
    let err = d.cli_err(&["checkpoint", "--workload", &w.name]);
    assert!(err.contains("holds network sockets") && err.contains("CRIU 4.2 or newer"), "{err}");
    assert!(err.contains("left running untouched"), "{err}");
    assert_eq!(procfs::tracer(w.pid), Some(0), "nothing may trace the workload after the refusal");
    let at_refusal = w.last_number("tick ").expect("ticks");
    w.wait_number("tick ", at_refusal + 5);

    // A tree without sockets is none of this CRIU's trouble.
    let c = d.run("old-criu-counter", &python_workload("counter.py", &[]));
    let seen = c.wait_number("count ", 3);
    d.json(&["checkpoint", "--workload", &c.name, "--json"]);
    procfs::wait_gone(c.pid, "the evicted counter to be gone");
    d.json(&["restore", "--workload", &c.name, "--json"]);
    c.wait_number("count ", seen + 3);
}
