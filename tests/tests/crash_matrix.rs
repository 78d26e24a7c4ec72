//! The crash matrix: stasisd is SIGKILLed at 32 points of an eviction, a `--leave-running`
//! checkpoint, an eager restore and a lazy restore of a real workload (128 MiB of random
//! memory), each point a delay after the request; then restarted on the same state directory
//! and store. After each, the workload runs with its memory intact, or a durable checkpoint of
//! it restores with its memory intact: never neither; no process is left stopped; every
//! checkpoint `stasis list` shows restores.

#![forbid(unsafe_code)]

use std::process::Stdio;
use std::time::Duration;

use stasis_tests::{
    Daemon, DaemonOptions, TIMEOUT, Workload, expect_within, pid_of, procfs, python_workload,
    skip_unless_ready,
};

/// Milliseconds after the request at which stasisd is killed.
const KILL_AFTER_MS: [u64; 8] = [0, 40, 120, 250, 400, 600, 900, 1400];

fn ids(d: &Daemon, w: &Workload) -> Vec<String> {
    let listed = d.json(&["list", "--workload", &w.name, "--json"]);
    listed["checkpoints"].as_array().unwrap().iter().map(|c| c["id"].as_str().unwrap().to_owned()).collect()
}

/// Runs `stasis ARGS` in the background, kills stasisd `after_ms` later, and restarts it.
fn kill_during(d: &mut Daemon, args: &[&str], after_ms: u64) {
    let mut request =
        d.command(args).stdout(Stdio::null()).stderr(Stdio::null()).spawn().expect("the request");
    std::thread::sleep(Duration::from_millis(after_ms));
    d.kill9_and_restart();
    let _ = request.wait();
}

/// After a crash: the workload runs with `sum` in memory (as the tree stasisd knows it by,
/// which a restore may have started before the crash), or it is gone and its newest
/// checkpoint restores with `sum`. Leaves it running. Returns which held.
fn settled(d: &Daemon, w: &mut Workload, sum: &str, point: &str) -> &'static str {
    // The restart's recovery gives a held tree back, or completes its eviction.
    w.pid = expect_within(TIMEOUT, &format!("{point}: the workload to be settled"), || {
        let pid = pid_of(&d.workload(&w.name));
        procfs::proc_state(pid).is_none_or(|s| s != 'T').then_some(pid)
    });
    let outcome = if procfs::running(w.pid) {
        "runs"
    } else {
        let newest = ids(d, w)
            .pop()
            .unwrap_or_else(|| panic!("{point}: the workload is gone and no checkpoint holds it"));
        w.restored(&d.json(&["restore", &newest, "--json"]));
        "restored"
    };
    assert_eq!(w.memhog_checksum(), sum, "{point}: the memory ({outcome})");
    // One tree only: none that a restore before the crash started runs on beside it.
    let tree: Vec<i32> = std::iter::once(w.pid).chain(procfs::descendants(w.pid)).collect();
    let strays: Vec<i32> =
        procfs::in_workload_cgroup(&w.name).into_iter().filter(|p| !tree.contains(p)).collect();
    assert!(strays.is_empty(), "{point}: processes of another copy run beside {}: {strays:?}", w.pid);
    outcome
}

#[test]
fn stasisd_killed_at_any_point_loses_neither_the_job_nor_its_checkpoint() {
    skip_unless_ready!();
    let mut d = Daemon::start_with(&DaemonOptions {
        args: ["--keep-last", "0", "--gc-grace-secs", "0"].map(String::from).to_vec(),
        ..Default::default()
    });
    let mut w = d.run("crashy", &python_workload("memhog.py", &["128"]));
    w.wait_line_after(0, "`ready`", |l| l == "ready");
    let sum = w.memhog_checksum();
    let mut seen = Vec::new();
    for after in KILL_AFTER_MS {
        let name = w.name.clone();
        for (what, args) in [
            ("eviction", vec!["checkpoint", "--workload", &name]),
            ("leave-running", vec!["checkpoint", "--workload", &name, "--leave-running"]),
        ] {
            let point = format!("{what} killed after {after} ms");
            kill_during(&mut d, &args, after);
            seen.push(settled(&d, &mut w, &sum, &point));
        }
        for (what, lazy) in [("eager restore", false), ("lazy restore", true)] {
            let point = format!("{what} killed after {after} ms");
            d.json(&["checkpoint", "--workload", &w.name, "--json"]);
            expect_within(TIMEOUT, "the evicted workload to be gone", || {
                (!procfs::exists(w.pid)).then_some(())
            });
            let mut args = vec!["restore", "--workload", &name];
            if lazy {
                args.push("--lazy");
            }
            kill_during(&mut d, &args, after);
            seen.push(settled(&d, &mut w, &sum, &point));
        }
    }
    eprintln!("outcomes: {seen:?}");
    assert_eq!(seen.len(), 32);
    // Every checkpoint left listed is whole.
    let checked = d.json(&["check", "--read-data", "--json"]);
    assert_eq!(checked["problems"].as_array().map(Vec::len), Some(0), "{checked}");
    // No lazy-restore guard of a killed stasisd is left holding a tree's userfaultfds: each
    // killed its tree and went. No CRIU of one is left either: each ended, or was ended by the
    // next start (one that killed a tree in a pid namespace of its own can deadlock with it).
    expect_within(TIMEOUT, "orphaned lazy-restore guards and CRIUs to be gone", || {
        let left = procfs::orphans(|argv| argv.first().is_some_and(|a| a.ends_with("stasis-lazy-guard")));
        (left.is_empty() && procfs::orphaned_criu().is_empty()).then_some(())
    });
}

/// The pids of stasisd's `criu swrk` children.
fn criu_children(d: &Daemon) -> Vec<i32> {
    let Ok(entries) = std::fs::read_dir("/proc") else { return Vec::new() };
    entries
        .flatten()
        .filter_map(|e| e.file_name().to_str()?.parse::<i32>().ok())
        .filter(|&pid| {
            let stat = std::fs::read_to_string(format!("/proc/{pid}/stat")).unwrap_or_default();
            let ppid = stat
                .rsplit_once(") ")
                .and_then(|(_, rest)| rest.split_whitespace().nth(1)?.parse::<i32>().ok());
            let cmdline = std::fs::read(format!("/proc/{pid}/cmdline")).unwrap_or_default();
            ppid == Some(d.pid()) && cmdline.split(|b| *b == 0).any(|arg| arg == b"swrk")
        })
        .collect()
}

/// Where in CRIU's dump it is killed: the line of its log (`state/work/<id>/criu.log`) that
/// marks the moment; `None` kills it as soon as it runs.
///
/// Not among them, on purpose: the few hundred microseconds per process in which CRIU has
/// pointed a process at code of its own that ends in a trap for CRIU to catch (injecting its
/// parasite, running it in a thread, removing it). A CRIU killed then leaves the process to
/// die of that trap, and nothing outside CRIU can give it back its registers; stasisd then
/// reports the job lost (`CheckpointError::Lost`, unit-tested). Everywhere else a dead CRIU
/// leaves the tree whole: while its parasite serves requests the parasite returns the
/// process to where it was on its own.
fn moment_reached(log: &str, main_pid: i32, moment: Option<&str>) -> bool {
    let Some(marker) = moment else { return true };
    // Pages: those of the workload's command (its parasite runs the whole transfer), not
    // stasis-init's, which are followed by the command's parasite being injected.
    let from = match marker {
        "page-xfer: Transferring pages" => match log.find(&format!("Dumping task (pid: {main_pid} ")) {
            Some(at) => at,
            None => return false,
        },
        _ => 0,
    };
    log[from..].contains(marker)
}

/// The CRIU log of the newest job in `d`'s state directory, if any yet.
fn dump_log(d: &Daemon) -> String {
    let Ok(jobs) = std::fs::read_dir(d.dir().join("state/work")) else { return String::new() };
    let newest = jobs.flatten().max_by_key(|j| j.metadata().and_then(|m| m.modified()).ok());
    newest.and_then(|j| std::fs::read_to_string(j.path().join("criu.log")).ok()).unwrap_or_default()
}

#[test]
fn criu_killed_mid_dump_leaves_the_job_running() {
    skip_unless_ready!();
    let d = Daemon::start();
    let mut w = d.run("crashy", &python_workload("memhog.py", &["128"]));
    w.wait_line_after(0, "`ready`", |l| l == "ready");
    let sum = w.memhog_checksum();
    let mut killed = 0;
    // Into CRIU's own life: as it starts, while it sends the pages, as it ends.
    for moment in [None, Some("page-xfer: Transferring pages"), Some("Running post-dump scripts")] {
        let point = format!("CRIU killed at {}", moment.unwrap_or("its start"));
        let main_pid = w.main_pid();
        let mut request = d
            .command(&["checkpoint", "--workload", &w.name])
            .stdout(Stdio::null())
            .stderr(Stdio::null())
            .spawn()
            .unwrap();
        // A quick dump may come and go between two looks: the request's end says so, and
        // that round kills nothing (the workload is then evicted, and settles restored).
        let criu = expect_within(TIMEOUT, "CRIU to start, or the request to end", || {
            let found = criu_children(&d);
            match found.is_empty() {
                false => Some(found),
                true => request.try_wait().ok().flatten().map(|_| Vec::new()),
            }
        });
        // Then the moment, looked for without pause: a dump of 128 MiB lasts some 100 ms.
        while !criu.is_empty()
            && !moment_reached(&dump_log(&d), main_pid, moment)
            && request.try_wait().ok().flatten().is_none()
        {
            std::thread::sleep(Duration::from_micros(200));
        }
        let alive = criu.iter().filter(|&&pid| procfs::exists(pid)).count();
        eprintln!("{point}: {alive} CRIU killed");
        killed += alive;
        criu.into_iter().for_each(procfs::kill9);
        let _ = request.wait();
        settled(&d, &mut w, &sum, &point);
    }
    assert!(killed > 0, "no CRIU was caught dumping");
}
