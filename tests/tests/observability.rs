//! Prometheus metrics (`--metrics-listen`): checkpoints and restores, ok and failed, counted
//! and timed as they happen, served on `GET /metrics`.

#![forbid(unsafe_code)]

use std::io::{Read, Write};

use stasis_tests::{Daemon, DaemonOptions, TIMEOUT, free_port, procfs, python_workload, skip_unless_ready};

fn get(port: u16, path: &str) -> String {
    let mut conn = std::net::TcpStream::connect(("127.0.0.1", port)).expect("the metrics port");
    conn.set_read_timeout(Some(TIMEOUT)).unwrap();
    conn.write_all(format!("GET {path} HTTP/1.1\r\nHost: x\r\n\r\n").as_bytes()).unwrap();
    let mut answer = String::new();
    conn.read_to_string(&mut answer).unwrap();
    answer
}

/// The value of the sample line `name` (with its labels) in `text`.
fn sample(text: &str, name: &str) -> Option<f64> {
    text.lines().find_map(|l| l.strip_prefix(name)?.strip_prefix(' ')?.parse().ok())
}

#[test]
fn checkpoints_and_restores_show_in_the_metrics() {
    skip_unless_ready!();
    let port = free_port();
    let d = Daemon::start_with(&DaemonOptions {
        args: vec!["--metrics-listen".into(), format!("127.0.0.1:{port}")],
        ..Default::default()
    });
    let before = get(port, "/metrics");
    assert!(before.starts_with("HTTP/1.1 200"), "{before}");
    assert_eq!(sample(&before, "stasis_frozen_seconds_count"), Some(0.0), "{before}");
    assert!(get(port, "/other").starts_with("HTTP/1.1 404"));
    // Clients that connect and send nothing hold no one else up, and are let go.
    let mut idle: Vec<std::net::TcpStream> =
        (0..8).map(|_| std::net::TcpStream::connect(("127.0.0.1", port)).unwrap()).collect();
    assert!(get(port, "/metrics").starts_with("HTTP/1.1 200"));
    let mut rest = Vec::new();
    idle[0].set_read_timeout(Some(TIMEOUT)).unwrap();
    let closed = idle[0].read_to_end(&mut rest);
    assert!(closed.is_ok(), "a silent client is closed (head timeout, 5 s), not kept: {closed:?}");
    drop(idle);

    let w = d.run("counted", &python_workload("counter.py", &[]));
    d.json(&["checkpoint", "--workload", &w.name, "--leave-running", "--json"]);
    d.cli_err(&["checkpoint", "999999999"]);
    d.json(&["checkpoint", "--workload", &w.name, "--json"]);
    procfs::wait_gone(w.pid, "the evicted counter to be gone");
    d.json(&["restore", "--workload", &w.name, "--json"]);

    let text = get(port, "/metrics");
    assert_eq!(sample(&text, "stasis_checkpoints_total{result=\"ok\"}"), Some(2.0), "{text}");
    assert_eq!(sample(&text, "stasis_checkpoints_total{result=\"failed\"}"), Some(1.0), "{text}");
    assert_eq!(sample(&text, "stasis_restores_total{result=\"ok\"}"), Some(1.0), "{text}");
    assert_eq!(sample(&text, "stasis_durable_seconds_count"), Some(2.0), "{text}");
    assert_eq!(sample(&text, "stasis_restore_first_run_seconds_count"), Some(1.0), "{text}");
    assert!(sample(&text, "stasis_uploaded_bytes_total").is_some_and(|b| b > 0.0), "{text}");
    assert!(
        sample(&text, "stasis_deduplicated_bytes_total").is_some_and(|b| b > 0.0),
        "the second checkpoint reused chunks: {text}"
    );
}
