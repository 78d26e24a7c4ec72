//! Copy-on-write sharing survives a restore (issue 24, item 2): a parent and the children it
//! forked share the pages none of them wrote since the fork, and after a restore they share
//! them again, as after CRIU's own restore, whichever way stasisd puts the memory in place
//! (served eagerly, lazily, or from image files). Measured as the tree's total PSS, which
//! counts a shared page once across the tree: it must come back within 5 % of what it was.

#![forbid(unsafe_code)]

use std::collections::BTreeMap;

use nix::sys::signal::Signal;
use stasis_tests::{
    Daemon, DaemonOptions, TIMEOUT, Workload, expect_within, procfs, python_workload, skip_unless_ready,
};

/// MiB of random bytes the parent holds and its children share.
const SHARED_MIB: u64 = 200;
const CHILDREN: usize = 3;
/// How far the restored tree's total PSS may be from the checkpointed one's.
const TOLERANCE: f64 = 0.05;

/// What the parent writes into the memory its children share.
#[derive(Clone, Copy, PartialEq)]
enum Fill {
    Random,
    /// Zeros: pages in memory that hold nothing, which the store keeps as zero chunks.
    Zeros,
}

/// Starts the pre-fork tree, its shared memory filled with `fill`, and waits until every
/// process of it is ready.
fn start_tree(d: &Daemon, fill: Fill) -> Workload {
    // Children that rewrite nothing: every page stays shared with the parent.
    let processes = (CHILDREN + 1).to_string();
    let fill = if fill == Fill::Zeros { "zeros" } else { "random" };
    let argv = python_workload("twins.py", &[&SHARED_MIB.to_string(), &processes, "0", "0", fill]);
    let w = d.run("cow", &argv);
    expect_within(TIMEOUT * 3, "every process of the tree to be ready", || {
        (w.lines().iter().filter(|l| l.starts_with("ready ")).count() == CHILDREN + 1).then_some(())
    });
    w
}

/// Each process's checksum of the shared buffer, by its pid (as the tree numbers it).
fn checksums(w: &Workload) -> BTreeMap<String, String> {
    checksums_of(w, CHILDREN + 1)
}

/// Each of the `processes` processes' checksum of its buffer, by its pid.
fn checksums_of(w: &Workload, processes: usize) -> BTreeMap<String, String> {
    let seen = w.lines().len();
    procfs::signal(w.main_pid(), Signal::SIGUSR2);
    expect_within(TIMEOUT * 3, "a checksum from every process of the tree", || {
        let sums: BTreeMap<String, String> = w.lines()[seen..]
            .iter()
            .filter_map(|l| {
                let mut words = l.strip_prefix("checksum ")?.split(' ');
                Some((words.next()?.to_owned(), words.next()?.to_owned()))
            })
            .collect();
        (sums.len() == processes).then_some(sums)
    })
}

/// The total PSS of the tree rooted at `root`, in KiB.
fn tree_pss_kib(root: i32) -> u64 {
    std::iter::once(root).chain(procfs::descendants(root)).filter_map(procfs::pss_kib).sum()
}

/// Fails unless `after` KiB is within [`TOLERANCE`] of `before` KiB.
fn assert_pss_kept(what: &str, before: u64, after: u64) {
    let ratio = after as f64 / before as f64;
    eprintln!("{what}: tree PSS {} MiB before, {} MiB after (x{ratio:.3})", before >> 10, after >> 10);
    assert!(
        (ratio - 1.0).abs() <= TOLERANCE,
        "{what}: the tree's total PSS was {before} KiB before the checkpoint and is {after} KiB \
         after (x{ratio:.2}): copy-on-write sharing between the parent and its {CHILDREN} \
         children was not kept"
    );
}

/// Runs the tree (its shared memory filled with `fill`) under a daemon with `options`,
/// checkpoints it (evicting it) and restores it with `restore` (extra `stasis restore`
/// flags); the tree's memory and its sharing must be what they were. With
/// `leave_running_first`, a `--leave-running` checkpoint comes first, and the running tree
/// must keep its sharing through it.
fn restore_keeps_sharing(
    what: &str,
    fill: Fill,
    options: &DaemonOptions,
    restore: &[&str],
    leave_running_first: bool,
) {
    let d = Daemon::start_with(options);
    let mut w = start_tree(&d, fill);
    let sums = checksums(&w);
    let before = tree_pss_kib(w.pid);
    assert!(
        before < (SHARED_MIB << 10) * 3 / 2,
        "the tree shares less than expected before any checkpoint: {before} KiB"
    );
    if leave_running_first {
        d.json(&["checkpoint", "--workload", &w.name, "--leave-running", "--json"]);
        assert_pss_kept(&format!("{what}, left running"), before, tree_pss_kib(w.pid));
    }
    let r = d.evict_and_restore(&mut w, restore);
    if restore.contains(&"--lazy") {
        assert!(r["stats"]["resident_ms"].as_u64().unwrap_or(0) > 0, "a lazy restore's answer: {r}");
    }
    assert_eq!(checksums(&w), sums, "{what}: the tree's memory differs after the restore");
    assert_pss_kept(what, before, tree_pss_kib(w.pid));
}

#[test]
fn a_served_restore_keeps_copy_on_write_sharing() {
    skip_unless_ready!();
    restore_keeps_sharing("served restore", Fill::Random, &DaemonOptions::default(), &[], true);
}

#[test]
fn a_served_restore_keeps_zeroed_memory_shared() {
    skip_unless_ready!();
    restore_keeps_sharing("served restore, zeros", Fill::Zeros, &DaemonOptions::default(), &[], false);
}

#[test]
fn a_lazy_restore_keeps_zeroed_memory_shared() {
    skip_unless_ready!();
    restore_keeps_sharing("lazy restore, zeros", Fill::Zeros, &DaemonOptions::default(), &["--lazy"], false);
}

#[test]
fn a_lazy_restore_keeps_copy_on_write_sharing() {
    skip_unless_ready!();
    restore_keeps_sharing("lazy restore", Fill::Random, &DaemonOptions::default(), &["--lazy"], false);
}

#[test]
fn a_restore_from_image_files_keeps_copy_on_write_sharing() {
    skip_unless_ready!();
    let options =
        DaemonOptions { args: vec!["--eager-restore".into(), "files".into()], ..Default::default() };
    restore_keeps_sharing("restore from image files", Fill::Random, &options, &[], false);
}

/// With transparent huge pages "always", a page CRIU's restore puts in place can bring a
/// whole huge page of zeros with it: a child's mapping that holds memory shared with its
/// parent (put in place by CRIU) next to memory that is its alone (left to the store) must
/// still come back whole, however the restore puts the memory in place.
fn shared_next_to_own_memory_is_restored(restore: &[&str]) {
    let _thp = procfs::HugePagesAlways::set();
    let d = Daemon::start();
    // 32 MiB shared, then 32 MiB each child fills after the fork.
    let mut w = d.run("grown", &python_workload("twins.py", &["32", "3", "0", "32"]));
    expect_within(TIMEOUT * 3, "every process of the tree to be ready", || {
        (w.lines().iter().filter(|l| l.starts_with("ready ")).count() == 3).then_some(())
    });
    let sums = checksums_of(&w, 3);
    d.evict_and_restore(&mut w, restore);
    assert_eq!(checksums_of(&w, 3), sums, "{restore:?}: the tree's memory differs after the restore");
    // Huge pages were off while CRIU put memory in place, and are on again as checkpointed.
    for pid in std::iter::once(w.pid).chain(procfs::descendants(w.pid)) {
        let thp = procfs::status_field(pid, "THP_enabled");
        assert_eq!(thp.as_deref(), Some("1"), "{restore:?}: restored pid {pid}'s THP_enabled");
    }
}

#[test]
fn a_lazy_restore_brings_back_memory_next_to_shared_memory() {
    skip_unless_ready!();
    shared_next_to_own_memory_is_restored(&["--lazy"]);
}

#[test]
fn a_served_restore_brings_back_memory_next_to_shared_memory() {
    skip_unless_ready!();
    shared_next_to_own_memory_is_restored(&[]);
}
