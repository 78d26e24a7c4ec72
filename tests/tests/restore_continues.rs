//! A checkpointed and evicted workload, once restored, goes on from where it was: same pids
//! (inside its own pid namespace), same memory, same pipes, same file offsets. Each test: run, checkpoint (the tree is killed
//! once the checkpoint is stored), restore, and check what the workload prints afterwards.

#![forbid(unsafe_code)]

use std::fmt::Write as _;

use stasis_tests::{
    Daemon, TIMEOUT, Workload, expect_within, memtest, procfs, python_workload, skip_unless_ready,
};

/// Checkpoints `w` by workload name without --leave-running; checks the result and that the
/// tree is gone afterwards.
fn evict(d: &Daemon, w: &Workload, tree: &[i32]) -> serde_json::Value {
    let ck = d.json(&["checkpoint", "--workload", &w.name, "--json"]);
    assert_eq!(ck["workload"], w.name.as_str(), "checkpoint result: {ck}");
    assert_eq!(ck["pid"], w.pid, "checkpoint result: {ck}");
    assert_eq!(ck["left_running"], false, "checkpoint result: {ck}");
    assert!(ck["id"].as_str().is_some_and(|id| !id.is_empty()), "checkpoint result: {ck}");
    assert!(ck["stats"]["bytes_total"].as_u64().is_some_and(|b| b > 0), "checkpoint result: {ck}");
    for pid in tree {
        expect_within(TIMEOUT, &format!("pid {pid} to be gone after the checkpoint"), || {
            (!procfs::exists(*pid)).then_some(())
        });
    }
    ck
}

/// Restores the latest checkpoint of `w`; checks it is `ck` and comes back with `w`'s pids.
fn restore(d: &Daemon, w: &mut Workload, ck: &serde_json::Value) -> serde_json::Value {
    restore_with(d, w, ck, &[])
}

/// [`restore`] with more arguments to `stasis restore`.
fn restore_with(d: &Daemon, w: &mut Workload, ck: &serde_json::Value, args: &[&str]) -> serde_json::Value {
    let mut command = vec!["restore", "--workload", &w.name, "--json"];
    command.extend(args);
    let r = d.json(&command);
    assert_eq!(r["id"], ck["id"], "restore result: {r}");
    assert_eq!(r["workload"], w.name.as_str(), "restore result: {r}");
    w.restored(&r);
    assert!(
        procfs::running(w.pid),
        "restored pid {} is not running: state {:?}",
        w.pid,
        procfs::proc_state(w.pid)
    );
    assert_eq!(procfs::tracer(w.pid), Some(0), "the restored process is still traced");
    assert_eq!(
        procfs::ppid(w.pid),
        Some(d.pid()),
        "stasisd should have adopted the restored tree (it reaps its workloads)"
    );
    r
}

/// The live children of `w`'s command, as its pid namespace numbers them.
fn children(w: &Workload) -> Vec<i32> {
    procfs::children(w.main_pid()).into_iter().filter(|&c| procfs::alive(c)).map(procfs::inner).collect()
}

/// Numbers printed with `prefix` in `w`'s log after its first `skip` lines.
fn numbers_after(w: &Workload, skip: usize, prefix: &str) -> Vec<u64> {
    let lines = w.lines();
    stasis_tests::numbered(&lines[skip.min(lines.len())..], prefix)
}

fn assert_consecutive(numbers: &[u64], what: &str) {
    for pair in numbers.windows(2) {
        assert_eq!(pair[1], pair[0] + 1, "{what}: not consecutive at {pair:?} in {numbers:?}");
    }
}

#[test]
fn counter_continues_after_eviction_and_restore() {
    skip_unless_ready!();
    let d = Daemon::start();
    let mut w = d.run("counter", &python_workload("counter.py", &[]));
    w.wait_number("count ", 10);

    let ck = evict(&d, &w, &[w.pid]);
    let before = w.lines().len();
    let last = w.last_number("count ").expect("counts before the checkpoint");
    assert!(last >= 10);
    assert_consecutive(&w.numbers("count "), "counts before the checkpoint");

    restore(&d, &mut w, &ck);
    w.wait_number("count ", last + 10);
    let after = numbers_after(&w, before, "count ");
    let first = after[0];
    assert!(
        first == last + 1 || first == last,
        "the restored counter should go on from {last}, but printed {first} first (then {after:?})"
    );
    assert_consecutive(&after, "counts after the restore");
    assert!(procfs::alive(w.pid));
}

#[test]
fn memtest_memory_is_identical_after_restore_and_threads_go_on() {
    skip_unless_ready!();
    let d = Daemon::start();
    let mut w = d.run("memtest", &memtest::argv(4, 16));
    memtest::wait_ready(&w);
    let tids = w.threads();
    assert_eq!(tids.len(), 5, "main thread and 4 workers: {tids:?}");
    let paused = memtest::pause(&w);

    let ck = evict(&d, &w, &[w.pid]);
    assert!(
        ck["stats"]["bytes_total"].as_u64().unwrap() >= 64 << 20,
        "64 MiB of written memory should be in the checkpoint: {ck}"
    );
    restore(&d, &mut w, &ck);
    assert_eq!(w.threads(), tids, "the restored process must have the same threads");
    assert_eq!(
        memtest::checksum(&w),
        paused.checksum,
        "memory after the restore differs from memory at the checkpoint"
    );
    // The restored threads keep working: they get past the batches done at the checkpoint.
    memtest::run_past(&w, paused.iterations);
}

#[test]
fn pipes_between_two_processes_work_after_restore() {
    skip_unless_ready!();
    let d = Daemon::start();
    let mut w = d.run("pipes", &python_workload("pipes.py", &[]));
    w.wait_number("roundtrip ", 10);
    // The pid it prints is the one its pid namespace gives it.
    let child = w.numbers("child ")[0] as i32;
    assert_eq!(children(&w), [child]);

    let tree: Vec<i32> = std::iter::once(w.pid).chain(procfs::descendants(w.pid)).collect();
    let ck = evict(&d, &w, &tree);
    let before = w.lines().len();
    let last = w.last_number("roundtrip ").unwrap();

    restore(&d, &mut w, &ck);
    assert_eq!(children(&w), [child], "the restored root should have its child {child} again");
    w.wait_number("roundtrip ", last + 10);

    let new: Vec<String> = w.lines()[before..].to_vec();
    let rounds = stasis_tests::numbered(&new, "roundtrip ");
    assert!(rounds[0] == last + 1 || rounds[0] == last, "roundtrips should go on after {last}: {new:?}");
    assert_consecutive(&rounds, "roundtrips after the restore");
    for line in new.iter().filter(|l| l.starts_with("roundtrip ")) {
        let n = line.split_whitespace().nth(1).unwrap();
        assert_eq!(*line, format!("roundtrip {n} PING {n}"), "wrong reply through the pipes");
    }
}

#[test]
fn file_offsets_are_kept_across_restore() {
    skip_unless_ready!();
    let d = Daemon::start();
    const LINE_LEN: u64 = "line 00001\n".len() as u64;
    let data = d.dir().join("data.txt");
    let mut text = String::with_capacity(99_999 * LINE_LEN as usize);
    for i in 1..=99_999 {
        writeln!(text, "line {i:05}").unwrap();
    }
    std::fs::write(&data, text).unwrap();
    let copy = d.dir().join("copy.txt");

    let mut w =
        d.run("reader", &python_workload("reader.py", &[data.to_str().unwrap(), copy.to_str().unwrap()]));
    w.wait_number("read line ", 10);

    let ck = evict(&d, &w, &[w.pid]);
    let before = w.lines().len();
    let last = w.last_number("read line ").unwrap();
    // The reader prints a line, then appends it to the copy: the checkpoint may have come
    // between the two.
    let copied = stasis_tests::complete_lines(&copy);
    let upto = if copied.len() as u64 == last { last } else { last - 1 };
    let expected: Vec<String> = (1..=upto).map(|i| format!("line {i:05}")).collect();
    assert_eq!(copied, expected, "the copy at checkpoint time should be lines 1..={last}");

    restore(&d, &mut w, &ck);
    w.wait_number("read line ", last + 5);
    let new = w.lines()[before..].to_vec();
    let first = new.first().expect("lines after the restore");
    assert_eq!(
        *first,
        format!("read line {:05} at {}", last + 1, (last + 1) * LINE_LEN),
        "the reader should go on with the line after {last} at its offset (lines after restore: {new:?})"
    );
    for line in &new {
        let n: u64 = line.split_whitespace().nth(2).and_then(|n| n.parse().ok()).unwrap_or_else(|| {
            panic!("unexpected line after the restore: {line}");
        });
        assert_eq!(*line, format!("read line {n:05} at {}", n * LINE_LEN), "offset of line {n}");
    }
    assert_consecutive(&stasis_tests::numbered(&new, "read line "), "lines read after the restore");

    let copied = stasis_tests::complete_lines(&copy);
    let upto = stasis_tests::numbered(&copied, "line ").last().copied().unwrap();
    let expected: Vec<String> = (1..=upto).map(|i| format!("line {i:05}")).collect();
    assert_eq!(copied, expected, "the copy should be every line once, in order, across the restore");
}

#[test]
fn processes_at_the_same_addresses_are_restored_through_a_small_cache() {
    skip_unless_ready!();
    // Each process's memory is many times the cache: chunks must leave it as soon as their
    // own process has them, whatever the other still lacks at the same addresses.
    let d = Daemon::start_with(&stasis_tests::DaemonOptions {
        args: vec!["--lazy-cache-mib".into(), "4".into()],
        ..Default::default()
    });
    let r = twins_restored(&d, 2, 48, &[]);
    assert_eq!(r["stats"]["lazy"], false, "{r}");
}

#[test]
fn a_tree_of_twelve_processes_is_restored_lazily_each_with_its_own_memory() {
    skip_unless_ready!();
    // More userfaultfds than one small message carries: the guard must hold them all.
    let d = Daemon::start();
    let r = twins_restored(&d, 12, 8, &["--lazy"]);
    assert_eq!(r["stats"]["lazy"], true, "{r}");
}

/// Runs twins.py (`processes` processes of `mib` MiB each, the children's first MiB rewritten),
/// evicts it, restores it with `args` and checks every process's memory; the restore's result.
fn twins_restored(d: &Daemon, processes: usize, mib: usize, args: &[&str]) -> serde_json::Value {
    let (n, size) = (processes.to_string(), mib.to_string());
    let mut w = d.run("twins", &python_workload("twins.py", &[&size, &n]));
    let ready = |w: &Workload| w.lines().iter().filter(|l| l.starts_with("ready ")).count();
    if stasis_tests::wait_for(TIMEOUT, || (ready(&w) == processes).then_some(())).is_none() {
        panic!("not every process said `ready`: {:?}", w.lines());
    }
    let sums = |w: &Workload, skip: usize| -> Vec<String> {
        procfs::signal(w.pid, nix::sys::signal::Signal::SIGUSR2);
        let mut got = expect_within(TIMEOUT, "every checksum", || {
            let lines = w.lines();
            let sums: Vec<String> = lines[skip.min(lines.len())..]
                .iter()
                .filter(|l| l.starts_with("checksum "))
                .cloned()
                .collect();
            (sums.len() == processes).then_some(sums)
        });
        got.sort();
        got
    };
    let before = sums(&w, 0);
    let distinct: std::collections::HashSet<&str> =
        before.iter().filter_map(|l| l.split(' ').nth(2)).collect();
    assert_eq!(distinct.len(), processes, "each child rewrote its copy: {before:?}");
    let tree: Vec<i32> = std::iter::once(w.pid).chain(procfs::descendants(w.pid)).collect();
    let ck = evict(d, &w, &tree);
    let r = restore_with(d, &mut w, &ck, args);
    let seen = w.lines().len();
    assert_eq!(sums(&w, seen), before, "every process's memory after the restore");
    r
}
