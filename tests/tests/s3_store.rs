//! The S3 path, against a real S3-compatible server process on loopback (moto's server,
//! installed by scripts/test.sh into .stasis/venv): checkpoint and restore through it, an
//! incremental second checkpoint, and a store that dies: the checkpoint fails with an error
//! about the store and the workload runs on, neither stopped nor killed.

#![forbid(unsafe_code)]

use std::io::{Read, Write};
use std::net::{TcpListener, TcpStream};
use std::path::PathBuf;
use std::process::{Child, Command, Stdio};
use std::time::Duration;

use stasis_tests::{
    Daemon, DaemonOptions, TIMEOUT, expect_within, procfs, python_workload, skip_unless_ready,
};

const BUCKET: &str = "stasis-test";

/// A moto S3 server on a free loopback port, killed on drop.
struct S3Server {
    child: Child,
    port: u16,
}

impl Drop for S3Server {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

fn moto_server() -> Option<PathBuf> {
    let path = std::env::var_os("STASIS_MOTO")
        .map(PathBuf::from)
        .unwrap_or_else(|| PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("../.stasis/venv/bin/moto_server"));
    path.exists().then_some(path)
}

fn start_s3(moto: &PathBuf) -> S3Server {
    let port = TcpListener::bind("127.0.0.1:0").unwrap().local_addr().unwrap().port();
    let child = Command::new(moto)
        .args(["-H", "127.0.0.1", "-p", &port.to_string()])
        .stdout(Stdio::null())
        .stderr(Stdio::null())
        .spawn()
        .expect("starting moto_server");
    let server = S3Server { child, port };
    expect_within(TIMEOUT, "the S3 server to listen", || TcpStream::connect(("127.0.0.1", port)).ok());
    let mut conn = TcpStream::connect(("127.0.0.1", port)).unwrap();
    write!(
        conn,
        "PUT /{BUCKET} HTTP/1.1\r\nHost: 127.0.0.1:{port}\r\nContent-Length: 0\r\nConnection: close\r\n\r\n"
    )
    .unwrap();
    let mut answer = String::new();
    conn.read_to_string(&mut answer).unwrap();
    assert!(answer.starts_with("HTTP/1.1 200"), "creating the bucket: {answer}");
    server
}

#[test]
fn checkpoints_go_through_a_real_s3_server_and_a_dead_one_leaves_the_job_running() {
    skip_unless_ready!();
    let Some(moto) = moto_server() else {
        eprintln!("skipping s3 test: moto_server not installed (scripts/test.sh installs it)");
        return;
    };
    let s3 = start_s3(&moto);
    let env = [
        ("AWS_ACCESS_KEY_ID", "test"),
        ("AWS_SECRET_ACCESS_KEY", "test"),
        ("AWS_DEFAULT_REGION", "us-east-1"),
        ("AWS_ALLOW_HTTP", "true"),
    ]
    .map(|(k, v)| (k.to_string(), v.to_string()))
    .into_iter()
    .chain([("AWS_ENDPOINT".to_string(), format!("http://127.0.0.1:{}", s3.port))])
    .collect();
    let d = Daemon::start_with(&DaemonOptions {
        store: Some(format!("s3://{BUCKET}/tenant-a")),
        args: vec!["--store-retry-secs".into(), "2".into()],
        env,
    });

    let w = d.run("counter", &python_workload("counter.py", &[]));
    w.wait_number("count ", 5);
    let ck = d.json(&["checkpoint", "--workload", &w.name, "--json"]);
    let at_checkpoint = w.last_number("count ").unwrap();
    expect_within(TIMEOUT, "the evicted counter to be gone", || (!procfs::exists(w.pid)).then_some(()));
    let first = ck["stats"]["bytes_uploaded"].as_u64().unwrap();
    assert!(first > 0, "{ck}");

    d.json(&["restore", ck["id"].as_str().unwrap(), "--json"]);
    let resumed = w.wait_number("count ", at_checkpoint + 1);
    assert!(resumed <= at_checkpoint + 3, "counting resumed from {at_checkpoint}, not elsewhere: {resumed}");
    let again = d.json(&["checkpoint", "--workload", &w.name, "--leave-running", "--json"]);
    let second = again["stats"]["bytes_uploaded"].as_u64().unwrap();
    assert!(second * 2 < first, "the second checkpoint over S3 is incremental: {second} vs {first}");

    // The store dies while the job runs; an evicting checkpoint must fail and resume the job.
    drop(s3);
    let err = d.cli_err(&["checkpoint", "--workload", &w.name, "--json"]);
    assert!(err.contains("storing checkpoint"), "the error names the store failure: {err}");
    assert!(
        procfs::running(w.pid),
        "the workload was killed or left stopped: state {:?}",
        procfs::proc_state(w.pid)
    );
    let before = w.last_number("count ").unwrap();
    std::thread::sleep(Duration::from_millis(500));
    w.wait_number("count ", before + 3);
    assert_ne!(procfs::proc_state(w.pid), Some('T'));
}
