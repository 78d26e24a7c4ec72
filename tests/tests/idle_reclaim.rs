//! Idle reclaim with real servers: an HTTP server and (in jupyter_kernel.rs) a Jupyter kernel
//! go quiet, are checkpointed and stopped, and come back on their next use with no retry by
//! the client; a request during the reclaim is answered, not lost; a wake while the store is
//! down fails clearly and leaves the checkpoint restorable. And what a reclaim reads of a real
//! dump to tell a program caught at work from one that waits.

#![forbid(unsafe_code)]

use std::time::{Duration, Instant};

use serde_json::Value;
use stasis_tests::proxy::TcpProxy;
use stasis_tests::s3::S3Server;
use stasis_tests::{
    Daemon, DaemonOptions, criu_path, expect_within, free_port, http_get, pid_of, procfs, python_workload,
    skip_unless_ready,
};

/// The status of workload `name`.
/// Starts `http_counter.py` on a free port as workload `name`, reclaimed after `idle_after`;
/// returns its port and pid.
fn http_server(d: &Daemon, name: &str, hold_mib: &str, idle_after: &str) -> (u16, i32) {
    let port = free_port();
    let mut args = vec!["run", "--workload", name, "--idle-after", idle_after, "--json", "--"];
    let argv = python_workload("http_counter.py", &[&port.to_string(), hold_mib]);
    args.extend(argv.iter().map(String::as_str));
    let pid = pid_of(&d.json(&args));
    expect_within(Duration::from_secs(60), "the server to answer", || http_get(port).ok());
    (port, pid)
}

fn wait_reclaimed(d: &Daemon, name: &str, pid: i32) -> Value {
    let status = expect_within(Duration::from_secs(60), "the workload to be reclaimed", || {
        let w = d.workload(name);
        (w["state"] == "reclaimed").then_some(w)
    });
    procfs::wait_gone(pid, "the reclaimed process to be gone");
    status
}

#[test]
fn an_idle_http_server_is_reclaimed_and_a_plain_request_wakes_it() {
    skip_unless_ready!();
    let d = Daemon::start();
    let name = d.workload_name("web");
    let (port, pid) = http_server(&d, &name, "64", "2s");
    let first = http_get(port).unwrap();
    assert!(first.starts_with("hits 2 sum "), "{first}");
    let w = d.workload(&name);
    assert_eq!((w["state"].as_str(), w["idle_after_ms"].as_u64()), (Some("running"), Some(2000)), "{w}");

    let reclaimed = wait_reclaimed(&d, &name, pid);
    let log = d.log_tail(400);
    assert!(!log.contains("cannot tell from the dump"), "the stopped tree's threads were read: {log}");
    let id = reclaimed["reclaimed_checkpoint"].as_str().expect("the reclaim's checkpoint").to_owned();
    let listed = d.json(&["list", "--json"]);
    assert!(listed["checkpoints"].as_array().unwrap().iter().any(|c| c["id"] == id.as_str()), "{listed}");
    let err = d.cli_err(&["delete", &id]);
    assert!(err.contains("wake it first"), "the checkpoint a reclaimed workload needs stays: {err}");

    // A plain client, no retry: stasisd holds the port, wakes the server and relays.
    let started = Instant::now();
    let answer = http_get(port).expect("the request that wakes the server");
    eprintln!("woken and answered in {:?}", started.elapsed());
    assert_eq!(answer, first.replace("hits 2", "hits 3"), "the counter and the memory go on");
    let w = d.workload(&name);
    let woken = pid_of(&w);
    assert_eq!(w["state"], "running", "{w}");
    assert!(procfs::running(woken) && procfs::is_namespace_init(woken), "{w}");
    // Later requests reach it directly; and it is watched again.
    assert!(http_get(port).unwrap().starts_with("hits 4 sum "));
    wait_reclaimed(&d, &name, woken);
    let answer = http_get(port).expect("a second wake");
    assert!(answer.starts_with("hits 5 sum "), "{answer}");
}

#[test]
fn a_request_during_the_reclaim_is_answered_and_the_server_runs_on() {
    skip_unless_ready!();
    let d = Daemon::start();
    let name = d.workload_name("busy");
    // 384 MiB of random memory: its checkpoint takes long enough to send a request meanwhile.
    let (port, pid) = http_server(&d, &name, "384", "1s");
    expect_within(Duration::from_secs(60), "the reclaim to start", || {
        (d.workload(&name)["state"] == "reclaiming").then_some(())
    });
    let answer = http_get(port).expect("a request during the reclaim");
    assert!(answer.starts_with("hits 2 sum "), "{answer}");
    d.ok(&["idle", &name, "--off"]);
    let w = expect_within(Duration::from_secs(60), "the reclaim to end", || {
        let w = d.workload(&name);
        (w["state"] != "reclaiming").then_some(w)
    });
    assert_eq!((w["state"].as_str(), w["pid"].as_i64()), (Some("running"), Some(i64::from(pid))), "{w}");
    assert!(procfs::running(pid), "the server runs on: {:?}", procfs::proc_state(pid));
    assert!(http_get(port).unwrap().starts_with("hits 3 sum "));
    let log = d.log_tail(200);
    assert!(log.contains("used during its reclaim"), "{log}");
}

#[test]
fn a_wake_while_the_store_is_down_fails_clearly_and_a_later_one_works() {
    skip_unless_ready!();
    let Some(s3) = S3Server::start() else { return };
    let proxy = TcpProxy::start(s3.port);
    let options: DaemonOptions = s3.daemon_options_at(proxy.port, "idle", &["--store-retry-secs", "5"]);
    let d = Daemon::start_with(&options);
    let name = d.workload_name("web");
    let (port, pid) = http_server(&d, &name, "32", "2s");
    wait_reclaimed(&d, &name, pid);

    proxy.take_down();
    let err = d.cli_err(&["wake", &name]);
    assert!(err.contains(&format!("waking workload {name} failed")), "{err}");
    assert!(err.contains("stays reclaimed"), "{err}");
    let w = d.workload(&name);
    assert_eq!(w["state"], "reclaimed", "{w}");
    assert!(!w["last_error"].as_str().unwrap_or_default().is_empty(), "status says why: {w}");

    proxy.bring_up();
    let woken = d.json(&["wake", &name, "--json"]);
    assert!(procfs::is_namespace_init(pid_of(&woken)), "{woken}");
    assert!(http_get(port).unwrap().starts_with("hits 2 sum "));
}

#[test]
fn a_workload_reclaimed_before_stasisd_restarts_is_woken_after() {
    skip_unless_ready!();
    let mut d = Daemon::start();
    let name = d.workload_name("web");
    let (port, pid) = http_server(&d, &name, "16", "1s");
    wait_reclaimed(&d, &name, pid);
    d.kill9_and_restart();
    assert_eq!(d.workload(&name)["state"], "reclaimed");
    let answer = http_get(port).expect("a request after the restart");
    assert!(answer.starts_with("hits 2 sum "), "{answer}");
}

#[test]
fn every_connection_that_arrives_during_a_wake_is_answered() {
    skip_unless_ready!();
    let d = Daemon::start();
    let name = d.workload_name("busy-wake");
    // 128 MiB to restore: the wake takes long enough for the later clients to arrive during it.
    let (port, pid) = http_server(&d, &name, "128", "1s");
    wait_reclaimed(&d, &name, pid);

    // Ten plain clients, 20 ms apart, the first of which wakes the server; then, once it
    // runs, a burst of 25 at once (more than its listen backlog of 5).
    let clients = |count: usize, apart: Duration| -> Vec<std::thread::JoinHandle<Result<String, String>>> {
        (0..count)
            .map(|_| {
                let client = std::thread::spawn(move || http_get(port));
                std::thread::sleep(apart);
                client
            })
            .collect()
    };
    let mut answers: Vec<Result<String, String>> =
        clients(10, Duration::from_millis(20)).into_iter().map(|c| c.join().unwrap()).collect();
    answers.extend(clients(25, Duration::ZERO).into_iter().map(|c| c.join().unwrap()));
    let failed: Vec<_> =
        answers.iter().filter(|a| !a.as_ref().is_ok_and(|a| a.starts_with("hits "))).collect();
    assert!(failed.is_empty(), "{} of {} connections not answered: {failed:?}", failed.len(), answers.len());
    let mut hits: Vec<u64> = answers
        .iter()
        .map(|a| a.as_ref().unwrap().split_whitespace().nth(1).unwrap().parse().unwrap())
        .collect();
    hits.sort_unstable();
    assert_eq!(hits, (2..37).collect::<Vec<u64>>(), "each connection served once, the counter going on");
}

#[test]
fn a_real_dump_tells_a_thread_at_work_from_threads_that_wait() {
    skip_unless_ready!();
    // The main thread sleeps (a system call), one thread computes, one waits on a lock.
    let script = "import threading, time\n\
        def spin():\n    x = 0\n    while True: x += 1\n\
        lock = threading.Lock(); lock.acquire()\n\
        threading.Thread(target=spin, daemon=True).start()\n\
        threading.Thread(target=lock.acquire, daemon=True).start()\n\
        print('ready', flush=True)\n\
        time.sleep(600)\n";
    // It leads a session of its own (setsid(1) execs in place, keeping the pid): where the test
    // runs in a pid namespace whose session leader is outside it, CRIU refuses the dump.
    let mut child = std::process::Command::new("setsid")
        .args(["python3", "-c", script])
        .stdin(std::process::Stdio::null())
        .stdout(std::process::Stdio::piped())
        .spawn()
        .unwrap();
    let mut ready = String::new();
    std::io::BufRead::read_line(&mut std::io::BufReader::new(child.stdout.take().unwrap()), &mut ready)
        .unwrap();
    let pid = child.id() as i32;
    let tids = procfs::tids(pid);
    assert_eq!(tids.len(), 3, "{tids:?}");
    // The spinning thread is the one using the CPU.
    let before: Vec<(i32, u64)> = tids.iter().map(|&t| (t, procfs::thread_cpu_ns(pid, t))).collect();
    std::thread::sleep(Duration::from_millis(300));
    let spinner = before.iter().max_by_key(|&&(t, b)| procfs::thread_cpu_ns(pid, t) - b).unwrap().0;

    let images = tempfile::tempdir().unwrap();
    let out = std::process::Command::new(criu_path())
        .args(["dump", "-t", &pid.to_string(), "--leave-running", "--shell-job", "-v2", "-D"])
        .arg(images.path())
        .args(["-o", "dump.log"])
        .output()
        .unwrap();
    let log = std::fs::read_to_string(images.path().join("dump.log")).unwrap_or_default();
    child.kill().unwrap();
    child.wait().unwrap();
    assert!(out.status.success(), "criu dump failed: {log}");
    let running = stasis_criu_images::running::running_threads(images.path()).unwrap();
    assert_eq!(running, [spinner as u32], "threads {tids:?}");
}
