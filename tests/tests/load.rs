//! Load: ten workloads checkpointed (left running, and evicted then restored) concurrently in
//! a loop for a bounded time. Every operation succeeds within its timeout (nothing deadlocks),
//! `stasis status` keeps answering within a second (the CLI's start included, on a loaded
//! two-core machine; a status that waited behind a job would take several), stasisd's memory
//! stays within its staging bound plus a constant, and every workload runs at the end.

#![forbid(unsafe_code)]

use std::path::PathBuf;
use std::process::{Command, Output};
use std::sync::mpsc;
use std::time::{Duration, Instant};

use stasis_tests::{Daemon, DaemonOptions, bin, procfs, python_workload, skip_unless_ready};

const WORKLOADS: usize = 10;
const RUN_FOR: Duration = Duration::from_secs(20);
const STEP_TIMEOUT: Duration = Duration::from_secs(120);
const STAGING_MIB: u64 = 64;
/// What stasisd may use beyond its staging bound, however many jobs run: six packs being
/// stored and six being fetched (32 MiB each), the runtime and the allocator's slack.
const CONSTANT_MIB: u64 = 512;

/// `stasis ARGS` against `socket`, failing if it takes longer than `timeout`.
fn stasis(socket: &PathBuf, args: &[&str], timeout: Duration) -> Result<(Output, Duration), String> {
    let mut cmd = Command::new(bin("stasis"));
    cmd.arg("--socket").arg(socket).args(args);
    let (tx, rx) = mpsc::channel();
    let started = Instant::now();
    std::thread::spawn(move || {
        let _ = tx.send(cmd.output());
    });
    match rx.recv_timeout(timeout) {
        Ok(Ok(out)) if out.status.success() => Ok((out, started.elapsed())),
        Ok(Ok(out)) => Err(format!("`stasis {}`: {}", args.join(" "), String::from_utf8_lossy(&out.stderr))),
        Ok(Err(e)) => Err(format!("`stasis {}`: {e}", args.join(" "))),
        Err(_) => Err(format!("`stasis {}` took more than {timeout:?}: a deadlock?", args.join(" "))),
    }
}

fn vm_rss_mib(pid: i32) -> u64 {
    procfs::status_bytes(pid, "VmRSS").unwrap_or(0) >> 20
}

#[test]
fn ten_workloads_checkpointed_and_restored_at_once_for_a_while() {
    skip_unless_ready!();
    let d = Daemon::start_with(&DaemonOptions {
        args: vec!["--staging-mib".into(), STAGING_MIB.to_string(), "--keep-last".into(), "2".into()],
        ..Default::default()
    });
    let socket = d.dir().join("stasisd.sock");
    let names: Vec<String> = (0..WORKLOADS)
        .map(|i| d.run(&format!("load{i}"), &python_workload("memhog.py", &["24"])).name)
        .collect();
    for w in &names {
        let ready = || stasis(&socket, &["status", "--json"], STEP_TIMEOUT).is_ok();
        assert!(ready(), "{w}");
    }
    std::thread::sleep(Duration::from_secs(2));

    let deadline = Instant::now() + RUN_FOR;
    let workers: Vec<_> = names
        .iter()
        .cloned()
        .map(|name| {
            let socket = socket.clone();
            std::thread::spawn(move || -> Result<u32, String> {
                let mut ops = 0;
                while Instant::now() < deadline {
                    stasis(
                        &socket,
                        &["checkpoint", "--workload", &name, "--leave-running", "--json"],
                        STEP_TIMEOUT,
                    )?;
                    if ops % 3 == 2 {
                        stasis(&socket, &["checkpoint", "--workload", &name, "--json"], STEP_TIMEOUT)?;
                        stasis(&socket, &["restore", "--workload", &name, "--json"], STEP_TIMEOUT)?;
                    }
                    ops += 1;
                }
                Ok(ops)
            })
        })
        .collect();

    let (mut slowest, mut peak_rss, mut polls) = (Duration::ZERO, 0, 0);
    while Instant::now() < deadline {
        let (_, took) =
            stasis(&socket, &["status", "--json"], Duration::from_secs(10)).expect("status during the load");
        slowest = slowest.max(took);
        peak_rss = peak_rss.max(vm_rss_mib(d.pid()));
        polls += 1;
        std::thread::sleep(Duration::from_millis(200));
    }
    let results: Vec<Result<u32, String>> =
        workers.into_iter().map(|w| w.join().expect("worker thread")).collect();
    let failures: Vec<&String> = results.iter().filter_map(|r| r.as_ref().err()).collect();
    assert!(failures.is_empty(), "operations failed under load: {failures:#?}\n{}", d.log_tail(60));
    let ops: u32 = results.iter().filter_map(|r| r.as_ref().ok()).sum();
    eprintln!(
        "{ops} checkpoint rounds; status: {polls} polls, slowest {slowest:?}; stasisd peak RSS {peak_rss} MiB"
    );
    assert!(ops >= WORKLOADS as u32, "every workload went through at least one round: {ops}");
    assert!(slowest < Duration::from_secs(1), "status took {slowest:?} under load");
    assert!(
        peak_rss <= STAGING_MIB + CONSTANT_MIB,
        "stasisd used {peak_rss} MiB, bound {STAGING_MIB} + {CONSTANT_MIB}"
    );
    for w in d.workloads() {
        let pid = w["pid"].as_i64().unwrap() as i32;
        assert_eq!(
            procfs::proc_state(pid).map(|s| s != 'T'),
            Some(true),
            "{w}: state {:?}",
            procfs::proc_state(pid)
        );
    }
}
