//! Networked processes: a tree holding a TCP listener, a TCP connection to a peer outside it,
//! a loopback TCP connection, a Unix listener and connection, a socketpair and UDP sockets is
//! evicted and restored, or checkpointed while it runs on, and every socket carries on.

#![forbid(unsafe_code)]

use stasis_tests::{
    Daemon, DaemonOptions, EchoPeer, TIMEOUT, Workload, expect_within, free_port, http_get, numbered, procfs,
    python_workload, skip_unless_ready,
};

/// Starts `net.py` with every socket kind (`--inner` adds the loopback ones), its peer
/// connection going to `peer`.
fn start(d: &Daemon, peer: &EchoPeer, http: u16, inner: bool) -> Workload {
    let (http, peer) = (http.to_string(), peer.port().to_string());
    let mut args = vec!["--http", &http, "--peer", &peer];
    if inner {
        args.push("--inner");
    }
    let w = d.run("net", &python_workload("net.py", &args));
    w.wait_number("tick ", 10);
    w
}

/// The memory checksum `tick N ok SUM` lines carry.
fn checksums(lines: &[String]) -> Vec<String> {
    lines
        .iter()
        .filter(|l| l.starts_with("tick "))
        .filter_map(|l| l.split_whitespace().nth(3))
        .map(String::from)
        .collect()
}

fn assert_consecutive(what: &str, numbers: &[u64]) {
    assert!(!numbers.is_empty(), "{what}: nothing");
    for pair in numbers.windows(2) {
        assert_eq!(pair[1], pair[0] + 1, "{what} should count without gaps or repeats: {numbers:?}");
    }
}

/// The HTTP listener answers a new client with the workload's current tick.
fn assert_http_answers(port: u16) {
    let body = http_get(port).unwrap_or_else(|e| panic!("HTTP GET on port {port}: {e}"));
    assert!(body.starts_with("tick "), "HTTP answer: {body:?}");
}

#[test]
fn eviction_and_restore_keep_every_socket_going() {
    skip_unless_ready!();
    evict_and_restore(&locking_with("nftables"), &[]);
}

#[test]
fn eviction_and_lazy_restore_keep_every_socket_going() {
    skip_unless_ready!();
    evict_and_restore(&locking_with("nftables"), &["--lazy"]);
}

#[test]
fn eviction_and_restore_with_the_iptables_lock_keep_every_socket_going() {
    skip_unless_ready!();
    evict_and_restore(&locking_with("iptables"), &[]);
}

#[test]
fn connections_are_locked_where_no_iptables_program_is_found() {
    skip_unless_ready!();
    // Debian keeps iptables in /usr/sbin: without it on PATH, `auto` must still lock.
    let d = Daemon::start_with(&DaemonOptions {
        env: vec![("PATH".into(), "/usr/bin:/bin".into())],
        ..Default::default()
    });
    assert_eq!(d.json(&["status", "--json"])["network_lock"], "nftables");
    evict_and_restore(&d, &[]);
}

fn locking_with(lock: &str) -> Daemon {
    Daemon::start_with(&DaemonOptions {
        args: vec!["--network-lock".into(), lock.into()],
        ..Default::default()
    })
}

/// Evicts the workload from `d`, restores it with `restore_flags`, and checks every socket
/// carried on.
fn evict_and_restore(d: &Daemon, restore_flags: &[&str]) {
    let lock = d.json(&["status", "--json"])["network_lock"].as_str().expect("network lock").to_owned();
    let peer = EchoPeer::start();
    let http = free_port();
    let mut w = start(d, &peer, http, true);
    assert_http_answers(http);

    let ck = d.json(&["checkpoint", "--workload", &w.name, "--json"]);
    let id = ck["id"].as_str().expect("checkpoint id").to_owned();
    assert_eq!(ck["left_running"], false, "checkpoint result: {ck}");
    procfs::wait_gone(w.pid, "the evicted tree to be gone");
    let before = w.lines();
    let at_eviction = *numbered(&before, "tick ").last().expect("ticks before the eviction");
    if lock == "nftables" {
        // The lock CRIU leaves is recorded, to be removed if no restore here takes it over.
        let locks = std::fs::read_dir(d.dir().join("state/netlocks")).expect("netlocks directory").count();
        assert_eq!(locks, 1, "the eviction's network lock should be recorded");
    }

    let shown = d.json(&["show", &id, "--json"]);
    let sockets: Vec<&str> =
        shown["sockets"].as_array().expect("sockets").iter().filter_map(|s| s.as_str()).collect();
    for expected in [
        format!("tcp listen 127.0.0.1:{http}"),
        format!("-> 127.0.0.1:{} (peer outside the tree)", peer.port()),
        "unix listen /".to_string(),
        "udp connected 127.0.0.1:".to_string(),
    ] {
        assert!(
            sockets.iter().any(|s| s.contains(&expected)),
            "`show` should list {expected:?}: {sockets:#?}"
        );
    }
    assert!(shown["criu_options"].to_string().contains(&format!("network-lock {lock}")), "{shown}");

    let mut restore = vec!["restore", &id, "--json"];
    restore.extend_from_slice(restore_flags);
    let r = d.json(&restore);
    w.restored(&r);
    assert_eq!(r["warnings"].as_array().map(Vec::len), Some(0), "restore result: {r}");
    w.wait_number("tick ", at_eviction + 20);
    assert_http_answers(http);

    let lines = w.lines();
    let after = &lines[before.len()..];
    let ticks = numbered(after, "tick ");
    assert!(
        ticks[0] <= at_eviction + 1,
        "the restored tree should carry on from tick {at_eviction}: {ticks:?}"
    );
    assert_consecutive("ticks after the restore", &ticks);
    let sums = checksums(&lines);
    assert!(sums.windows(2).all(|p| p[0] == p[1]), "the held memory changed across the restore: {sums:?}");
    // The peer saw one conversation: every number once, in order, and never a reset.
    let echoed = numbered(&lines, "echo ");
    assert_consecutive("numbers the peer received", &peer.numbers());
    assert_consecutive("echoes the workload read", &echoed);
    assert!(*peer.numbers().last().unwrap() > at_eviction, "the peer got nothing after the restore");
    assert_eq!(peer.ended(), None, "the peer's connection should never have ended");
}

#[test]
fn leave_running_only_pauses_the_peer_and_a_later_restore_without_it_resets_that_connection() {
    skip_unless_ready!();
    let d = Daemon::start();
    let mut peer = EchoPeer::start();
    let http = free_port();
    let w = start(&d, &peer, http, true);

    let ck = d.json(&["checkpoint", "--workload", &w.name, "--leave-running", "--json"]);
    let id = ck["id"].as_str().expect("checkpoint id").to_owned();
    let at_return = w.last_number("tick ").expect("ticks");
    w.wait_number("tick ", at_return + 10);
    assert_http_answers(http);
    assert_consecutive("numbers the peer received", &peer.numbers());
    assert_consecutive("echoes the workload read", &w.numbers("echo "));
    assert_eq!(peer.ended(), None, "the peer should notice nothing but a pause");

    // The original goes away, and so does the peer: a restore finds the connection's other
    // end gone, says so, and the workload sees only that connection fail.
    procfs::kill9(w.pid);
    procfs::wait_gone(w.pid, "the killed original to be gone");
    expect_within(TIMEOUT, "the peer to see the killed original's connection end", || peer.ended());
    peer.disconnect();
    let before = w.lines().len();
    let r = d.json(&["restore", &id, "--json"]);
    let warnings = r["warnings"].to_string();
    assert!(warnings.contains("peer is gone"), "the restore should warn of the gone peer: {r}");
    let (_, lost) = w.wait_line_after(before, "the restored workload to find its peer gone", |l| {
        l.starts_with("peer lost")
    });
    assert!(lost.contains("ConnectionResetError"), "the lost connection should be reset: {lost}");
    let last = w.last_number("tick ").expect("ticks");
    w.wait_number("tick ", last + 10);
    assert_http_answers(http);
    let ticks = numbered(&w.lines()[before..], "tick ");
    assert!(ticks[0] <= at_return + 1, "the restored tree should carry on from its checkpoint: {ticks:?}");
    assert_consecutive("ticks after the restore", &ticks);
}

#[test]
fn tcp_close_restores_connections_closed_and_listeners_live() {
    skip_unless_ready!();
    let d = Daemon::start();
    let peer = EchoPeer::start();
    let http = free_port();
    let w = start(&d, &peer, http, false);
    let ck = d.json(&["checkpoint", "--workload", &w.name, "--json"]);
    let id = ck["id"].as_str().expect("checkpoint id").to_owned();
    procfs::wait_gone(w.pid, "the evicted tree to be gone");

    let before = w.lines().len();
    let r = d.json(&["restore", &id, "--tcp-close", "--json"]);
    assert!(r["warnings"].to_string().contains("restored closed (--tcp-close)"), "restore result: {r}");
    let (_, lost) = w.wait_line_after(before, "the restored workload to find its connection closed", |l| {
        l.starts_with("peer lost")
    });
    let closed = ["BrokenPipeError", "ConnectionResetError"];
    assert!(closed.iter().any(|e| lost.contains(e)), "a connection restored closed should fail: {lost}");
    let last = w.last_number("tick ").expect("ticks");
    w.wait_number("tick ", last + 5);
    assert_http_answers(http);
    // The peer's side is still open (its packets were only dropped while the tree was away).
    assert_eq!(peer.ended(), None);
}
