//! Networked processes that cannot be checkpointed or restored as they are: each attempt fails
//! with an error naming what is wrong, and leaves the workload (or the checkpoint) untouched.

#![forbid(unsafe_code)]

use stasis_tests::{Daemon, DaemonOptions, free_port, http_get, procfs, python_workload, skip_unless_ready};

#[test]
fn a_socket_kind_criu_cannot_dump_is_refused_before_the_tree_is_frozen() {
    skip_unless_ready!();
    let d = Daemon::start();
    let w = d.run("vsock", &python_workload("net.py", &["--vsock"]));
    w.wait_number("tick ", 5);

    let err = d.cli_err(&["checkpoint", "--workload", &w.name]);
    assert!(err.contains("AF_VSOCK socket of pid"), "the error should name the socket: {err}");
    assert!(err.contains("left running untouched"), "the error should say the workload runs on: {err}");
    assert_eq!(procfs::tracer(w.pid), Some(0), "nothing may trace the workload after the refusal");
    let at_refusal = w.last_number("tick ").expect("ticks");
    w.wait_number("tick ", at_refusal + 5);
    assert!(procfs::running(w.pid), "state of the workload: {:?}", procfs::proc_state(w.pid));
    let listed = d.json(&["list", "--json"]);
    assert_eq!(listed["checkpoints"].as_array().map(Vec::len), Some(0), "nothing may be stored: {listed}");
}

#[test]
fn a_taken_port_refuses_the_restore_and_leaves_the_checkpoint_restorable() {
    skip_unless_ready!();
    let d = Daemon::start();
    let port = free_port();
    let mut w = d.run("listener", &python_workload("net.py", &["--http", &port.to_string()]));
    w.wait_number("tick ", 5);
    let ck = d.json(&["checkpoint", "--workload", &w.name, "--json"]);
    let id = ck["id"].as_str().expect("checkpoint id").to_owned();
    procfs::wait_gone(w.pid, "the evicted tree to be gone");

    let squatter = std::net::TcpListener::bind(("127.0.0.1", port)).expect("taking the workload's port");
    let err = d.cli_err(&["restore", &id]);
    let me = std::process::id();
    assert!(err.contains(&format!("port {port}/tcp (127.0.0.1) is in use by pid {me}")), "{err}");
    assert!(err.contains("nothing was restored"), "{err}");
    let left = procfs::in_workload_cgroup(&w.name);
    assert!(
        !procfs::exists(w.pid) && left.is_empty(),
        "nothing of the tree may run after a refused restore: {left:?}"
    );

    drop(squatter);
    let r = d.json(&["restore", &id, "--json"]);
    w.restored(&r);
    let body = http_get(port).unwrap_or_else(|e| panic!("HTTP GET after the restore: {e}"));
    assert!(body.starts_with("tick "), "HTTP answer: {body:?}");
}

#[test]
fn an_eviction_whose_storing_fails_gives_the_tree_its_connections_back() {
    skip_unless_ready!();
    failed_eviction_gives_connections_back("nftables");
}

#[test]
fn an_eviction_whose_storing_fails_gives_the_tree_its_iptables_locked_connections_back() {
    skip_unless_ready!();
    failed_eviction_gives_connections_back("iptables");
}

/// A daemon locking connections with `lock` fails to store an eviction of a tree talking to
/// a peer outside it: the tree must be resumed with its connections working.
fn failed_eviction_gives_connections_back(lock: &str) {
    let d = Daemon::start_with(&DaemonOptions {
        args: vec!["--network-lock".into(), lock.into()],
        ..Default::default()
    });
    let peer = stasis_tests::EchoPeer::start();
    let w = d.run("net-fail", &python_workload("net.py", &["--inner", "--peer", &peer.port().to_string()]));
    w.wait_number("echo ", 5);
    // A file where the store keeps its packs: every upload fails.
    let packs = d.store_dir().join("packs");
    let _ = std::fs::remove_dir_all(&packs);
    std::fs::create_dir_all(d.store_dir()).expect("store directory");
    std::fs::write(&packs, b"in the way").expect("blocking the packs directory");

    let err = d.cli_err(&["checkpoint", "--workload", &w.name]);
    assert!(err.contains("storing checkpoint"), "the error should name the store failure: {err}");
    assert!(!err.contains("incomplete"), "the rollback should have undone everything: {err}");
    assert!(procfs::running(w.pid), "state of the workload: {:?}", procfs::proc_state(w.pid));
    // CRIU left the dumped connection in repair mode and locked: stasisd must undo both, or
    // the conversation with the peer stalls.
    let echoed = w.last_number("echo ").expect("echoes");
    w.wait_number("echo ", echoed + 10);
    let numbers = peer.numbers();
    assert!(numbers.windows(2).all(|p| p[1] == p[0] + 1), "the peer's numbers: {numbers:?}");
    assert_eq!(peer.ended(), None, "the peer's connection should never have ended");
    let ticks = w.numbers("tick ");
    assert!(ticks.windows(2).all(|p| p[1] == p[0] + 1), "ticks: {ticks:?}");
}
