//! A restore whose memory turns out damaged while CRIU is still building the tree ends, in
//! bounded time, with the tree and CRIU gone and its scratch removed, and holds nothing that
//! later checkpoints or garbage collection would wait for. (Killing the tree while CRIU still
//! traced it used to deadlock: each killed process waited for CRIU to reap it, the namespace's
//! init waited for them, and CRIU for the init; the restore then held the store's commit guard
//! for good, and every checkpoint queued behind the collection that waited for it.)

#![forbid(unsafe_code)]

use std::time::{Duration, Instant};

use stasis_tests::{Daemon, TIMEOUT, expect_within, procfs, python_workload, skip_unless_ready};

/// The processes of the workload.
const PROCESSES: usize = 24;

/// The restore scratch directories in /dev/shm.
fn scratch() -> Vec<String> {
    std::fs::read_dir("/dev/shm")
        .map(|entries| {
            entries
                .flatten()
                .map(|e| e.file_name().to_string_lossy().into_owned())
                .filter(|n| n.starts_with("stasis-restore-"))
                .collect()
        })
        .unwrap_or_default()
}

#[test]
fn a_restore_of_damaged_memory_ends_and_holds_nothing_up() {
    skip_unless_ready!();
    let d = Daemon::start();
    let w = d.run("twins", &python_workload("twins.py", &["4", &PROCESSES.to_string()]));
    expect_within(TIMEOUT, "every process to be ready", || {
        (w.lines().iter().filter(|l| l.starts_with("ready ")).count() == PROCESSES).then_some(())
    });
    let ck = d.json(&["checkpoint", "--workload", &w.name, "--json"]);
    let id = ck["id"].as_str().expect("a checkpoint id").to_string();
    procfs::wait_gone(w.pid, "the evicted tree to be gone");

    // Every pack damaged all through its middle half, a byte every 16 KiB: the memory of many
    // processes fails its check, some of it while CRIU is still building the tree.
    let packs = d.dir().join("store/packs");
    let mut damaged = 0;
    for pack in std::fs::read_dir(&packs).expect("the store's packs").flatten() {
        let mut data = std::fs::read(pack.path()).unwrap();
        let len = data.len();
        for at in (len / 4..len * 3 / 4).step_by(16 << 10) {
            data[at] ^= 0xff;
        }
        std::fs::write(pack.path(), data).unwrap();
        damaged += 1;
    }
    assert!(damaged > 0, "no pack in {}", packs.display());

    let scratch_before = scratch();
    for (args, copy) in [
        (&[][..], None),
        (&["--lazy"][..], None),
        (&["--as", "twins-copy", "--lazy"][..], Some("twins-copy")),
    ] {
        let mut cmd = vec!["restore", id.as_str()];
        cmd.extend(args);
        let started = Instant::now();
        let err = d.cli_err(&cmd);
        let took = started.elapsed();
        assert!(took < Duration::from_secs(90), "`stasis {}` took {took:?}", cmd.join(" "));
        assert!(err.contains("corrupt"), "`stasis {}` says what was wrong: {err}", cmd.join(" "));
        if !args.contains(&"--lazy") {
            assert!(!err.contains("lazy"), "an eager restore's failure is not called lazy: {err}");
        }
        let name = copy.unwrap_or(&w.name);
        expect_within(TIMEOUT, "nothing of the failed restore to be left", || {
            let left = procfs::in_workload_cgroup(name);
            left.is_empty().then_some(())
        });
    }
    let left: Vec<String> = scratch().into_iter().filter(|s| !scratch_before.contains(s)).collect();
    assert!(left.is_empty(), "restore scratch left in /dev/shm: {left:?}");

    // Nothing waits for the failed restores: a checkpoint and a collection go ahead.
    let other = d.run("other", &python_workload("counter.py", &[]));
    other.wait_line_after(0, "a first count", |_| true);
    let started = Instant::now();
    d.json(&["checkpoint", "--workload", &other.name, "--leave-running", "--json"]);
    d.json(&["gc", "--json"]);
    assert!(started.elapsed() < Duration::from_secs(60), "checkpoint and gc took {:?}", started.elapsed());
}
