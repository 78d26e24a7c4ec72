//! Wrong pids, unknown or malformed ids, and damaged checkpoints in the store: each is a
//! clean error (exit status 1, `error: ...` saying what is wrong), and the daemon keeps
//! serving. One test, and one daemon, per case.

#![forbid(unsafe_code)]

use std::fs::OpenOptions;
use std::path::{Path, PathBuf};

use stasis_tests::{Daemon, Workload, procfs, python_workload, skip_unless_ready};

/// A well-formed checkpoint id that no store holds.
const UNKNOWN_ID: &str = "20200101-000000-abcdef";

/// An id that would be a path outside the store, were it used as one.
const PATH_LIKE_ID: &str = "../../etc";

/// Runs `stasis <args>`, which must fail with an error mentioning one of `any_of`, and checks
/// that the daemon still answers afterwards; returns the error.
fn refused(d: &Daemon, args: &[&str], any_of: &[&str]) -> String {
    let what = format!("`stasis {}`", args.join(" "));
    let err = d.cli_err(args);
    let lower = err.to_lowercase();
    assert!(
        any_of.iter().any(|needle| lower.contains(needle)),
        "{what}: the error should mention one of {any_of:?}, got:\n{err}"
    );
    let out = d.cli(&["status", "--json"]);
    assert!(
        out.status.success(),
        "stasisd stopped serving after {what}: {}\n{}",
        String::from_utf8_lossy(&out.stderr),
        d.log_tail(40)
    );
    err
}

/// Runs a counter and checkpoints it (evicting it); returns (checkpoint id, the workload).
fn evicted_counter(d: &Daemon, base: &str) -> (String, Workload) {
    let w = d.run(base, &python_workload("counter.py", &[]));
    w.wait_number("count ", 5);
    let ck = d.json(&["checkpoint", "--workload", &w.name, "--json"]);
    procfs::wait_gone(w.pid, "the evicted counter to be gone");
    (ck["id"].as_str().expect("checkpoint id").to_owned(), w)
}

/// Checks that nothing of workload `w` runs: no process in its cgroup (a restored tree with
/// its own pid namespace has new pids), nor its old root.
fn nothing_runs(w: &Workload, after: &str) {
    let left = procfs::in_workload_cgroup(&w.name);
    assert!(!procfs::alive(w.pid) && left.is_empty(), "{after} left {} running: {left:?}", w.name);
}

/// A daemon with one evicted counter whose manifest then had a byte flipped; returns the daemon,
/// the checkpoint's id and the counter.
fn daemon_with_a_flipped_manifest() -> (Daemon, String, Workload) {
    let d = Daemon::start();
    let (id, w) = evicted_counter(&d, "flipped");
    flip_byte_in_the_middle(&d.store_dir().join("manifests").join(format!("{id}.manifest")));
    (d, id, w)
}

fn flip_byte_in_the_middle(path: &Path) {
    let mut bytes = std::fs::read(path).unwrap_or_else(|e| panic!("{}: {e}", path.display()));
    assert!(bytes.len() > 16, "{} is suspiciously small", path.display());
    let middle = bytes.len() / 2;
    bytes[middle] ^= 0x01;
    std::fs::write(path, bytes).unwrap();
}

fn truncate_by_one(path: &Path) {
    let file =
        OpenOptions::new().write(true).open(path).unwrap_or_else(|e| panic!("{}: {e}", path.display()));
    let len = file.metadata().unwrap().len();
    assert!(len > 0, "{} is empty", path.display());
    file.set_len(len - 1).unwrap();
}

fn delete(path: &Path) {
    std::fs::remove_file(path).unwrap_or_else(|e| panic!("{}: {e}", path.display()));
}

/// The pack data files of the daemon's store.
fn pack_files(d: &Daemon) -> Vec<PathBuf> {
    let dir = d.store_dir().join("packs");
    let Ok(entries) = std::fs::read_dir(&dir) else { return Vec::new() };
    entries.map(|e| e.unwrap().path()).filter(|p| p.extension().is_some_and(|x| x == "pack")).collect()
}

/// Runs `stasis <verb> ../../etc [flags]` next to a directory `etc` holding a file: it must be
/// refused as not an id, and the file must still be there.
fn path_like_id_is_refused(verb: &str, flags: &[&str]) {
    let d = Daemon::start();
    let canary = d.dir().join("etc");
    std::fs::create_dir(&canary).unwrap();
    std::fs::write(canary.join("keep"), "x").unwrap();
    let mut args = vec![verb, PATH_LIKE_ID];
    args.extend_from_slice(flags);
    refused(&d, &args, &["not a checkpoint id"]);
    assert!(canary.join("keep").exists(), "`stasis {verb} {PATH_LIKE_ID}` touched a file outside the store");
}

/// Evicts a counter to a fresh store, does `damage` to the packs its checkpoint wrote, and
/// restores it: the restore must fail with an error naming the checkpoint and mentioning one of
/// `expected`, and leave nothing running. (A store of its own: checkpoints share chunks, so
/// damage to one pack would show in every checkpoint referencing a chunk in it.)
fn restore_with_damaged_packs(base: &str, damage: fn(&Path), expected: &[&str]) {
    restore_with_damaged_packs_as(base, damage, expected, &[]);
}

/// [`restore_with_damaged_packs`], restoring with `flags`.
fn restore_with_damaged_packs_as(base: &str, damage: fn(&Path), expected: &[&str], flags: &[&str]) {
    let d = Daemon::start();
    let before = pack_files(&d);
    let (id, w) = evicted_counter(&d, base);
    let fresh: Vec<_> = pack_files(&d).into_iter().filter(|p| !before.contains(p)).collect();
    assert!(!fresh.is_empty(), "checkpoint {id} wrote no pack");
    fresh.iter().for_each(|p| damage(p));

    let mut restore = vec!["restore", &id, "--json"];
    restore.extend_from_slice(flags);
    let err = refused(&d, &restore, expected);
    assert!(err.contains(&id), "the error should name checkpoint {id}:\n{err}");
    nothing_runs(&w, "a failed restore");
    // Its manifest is intact, so show works; the damage is found when the data is read.
    let shown = d.json(&["show", &id, "--json"]);
    assert_eq!(shown["pid"], w.pid, "show of checkpoint {id} with {base} packs: {shown}");
}

#[test]
fn checkpoint_of_a_pid_that_does_not_exist_says_it_does_not_exist() {
    skip_unless_ready!();
    let d = Daemon::start();
    let missing_pid = 4_000_000;
    assert!(!procfs::exists(missing_pid));
    refused(&d, &["checkpoint", &missing_pid.to_string(), "--json"], &["does not exist"]);
}

#[test]
fn checkpoints_of_init_a_kernel_thread_stasisd_or_a_tree_holding_stasisd_are_refused_up_front() {
    skip_unless_ready!();
    let d = Daemon::start();
    let stasisd = d.pid().to_string();
    refused(&d, &["checkpoint", "1"], &["it is init"]);
    // kthreadd on a host; a pid namespace sees none (CI may run the tests in one).
    if let Some(kthread) = procfs::kernel_thread() {
        refused(&d, &["checkpoint", &kthread.to_string()], &["it is a kernel thread"]);
    }
    refused(&d, &["checkpoint", &stasisd], &["it is stasisd itself"]);
    // stasisd's parent here is this test process: its tree holds stasisd.
    let me = std::process::id().to_string();
    refused(&d, &["checkpoint", &me], &[&format!("its tree holds process {stasisd}, stasisd itself")]);
    assert!(procfs::running(d.pid()), "stasisd must not have frozen itself");
    assert_eq!(procfs::tracer(d.pid()), Some(0), "nothing may trace stasisd");
}

#[test]
fn restore_of_an_unknown_id_says_not_found() {
    skip_unless_ready!();
    refused(&Daemon::start(), &["restore", UNKNOWN_ID, "--json"], &["not found"]);
}

#[test]
fn show_of_an_unknown_id_says_not_found() {
    skip_unless_ready!();
    refused(&Daemon::start(), &["show", UNKNOWN_ID, "--json"], &["not found"]);
}

#[test]
fn restore_of_a_path_like_id_is_refused_as_not_an_id() {
    skip_unless_ready!();
    path_like_id_is_refused("restore", &["--json"]);
}

#[test]
fn show_of_a_path_like_id_is_refused_as_not_an_id() {
    skip_unless_ready!();
    path_like_id_is_refused("show", &["--json"]);
}

#[test]
fn delete_of_a_path_like_id_is_refused_and_deletes_nothing_outside_the_store() {
    skip_unless_ready!();
    path_like_id_is_refused("delete", &[]);
}

#[test]
fn restore_of_a_checkpoint_with_a_flipped_manifest_byte_says_corrupted_and_starts_nothing() {
    skip_unless_ready!();
    let (d, id, w) = daemon_with_a_flipped_manifest();
    refused(&d, &["restore", &id, "--json"], &["corrupted", "checksum"]);
    nothing_runs(&w, "a refused restore");
}

#[test]
fn show_of_a_checkpoint_with_a_flipped_manifest_byte_says_corrupted() {
    skip_unless_ready!();
    let (d, id, _) = daemon_with_a_flipped_manifest();
    refused(&d, &["show", &id, "--json"], &["corrupted", "checksum"]);
}

#[test]
fn list_leaves_out_a_checkpoint_with_a_damaged_manifest_and_lists_the_others() {
    skip_unless_ready!();
    let (d, damaged, _) = daemon_with_a_flipped_manifest();
    let (intact, _) = evicted_counter(&d, "intact");
    let listed = d.json(&["list", "--json"]);
    let ids: Vec<&str> = listed["checkpoints"]
        .as_array()
        .unwrap_or_else(|| panic!("no checkpoints array in {listed}"))
        .iter()
        .filter_map(|c| c["id"].as_str())
        .collect();
    assert_eq!(ids, [intact.as_str()], "list with {damaged} damaged: {listed}");
    let unreadable = listed["unreadable"].to_string();
    assert!(unreadable.contains(&damaged), "list should name the unreadable checkpoint: {listed}");
}

#[test]
fn gc_stops_rather_than_collect_the_data_of_an_unreadable_checkpoint() {
    skip_unless_ready!();
    let (d, damaged, _) = daemon_with_a_flipped_manifest();
    let packs = pack_files(&d);
    let err = refused(&d, &["gc"], &["garbage collection stopped"]);
    assert!(err.contains(&damaged), "the error should name the checkpoint: {err}");
    assert_eq!(pack_files(&d), packs, "gc must not delete any pack while a manifest is unreadable");
}

#[test]
fn restore_with_a_flipped_byte_in_a_pack_says_corrupted() {
    skip_unless_ready!();
    restore_with_damaged_packs("corrupt", flip_byte_in_the_middle, &["corrupted"]);
}

#[test]
fn lazy_restore_with_a_flipped_byte_in_a_pack_says_corrupted() {
    skip_unless_ready!();
    restore_with_damaged_packs_as("lazy-corrupt", flip_byte_in_the_middle, &["corrupted"], &["--lazy"]);
}

#[test]
fn restore_with_a_pack_missing_its_last_byte_says_truncated() {
    skip_unless_ready!();
    restore_with_damaged_packs("truncated", truncate_by_one, &["truncated"]);
}

#[test]
fn restore_with_a_deleted_pack_says_missing() {
    skip_unless_ready!();
    restore_with_damaged_packs("missing", delete, &["missing"]);
}

#[test]
fn gc_runs_past_a_truncated_pack_index_keeping_that_pack_and_naming_it() {
    skip_unless_ready!();
    let d = Daemon::start();
    let (kept, w) = evicted_counter(&d, "kept");
    let pack_file = pack_files(&d).into_iter().next().expect("the checkpoint wrote a pack");
    let damaged = pack_file.with_extension("idx");
    truncate_by_one(&damaged);
    let pack = damaged.file_stem().and_then(|s| s.to_str()).expect("pack name").to_owned();
    let report = d.json(&["gc", "--json"]);
    assert_eq!(report["damaged_packs"], serde_json::json!([pack]), "gc report: {report}");
    assert!(damaged.with_extension("pack").exists(), "the pack with the damaged index must be kept");
    // The checkpoint is still listed; its restore finds the damage when it reads the index.
    let shown = d.json(&["show", &kept, "--json"]);
    assert_eq!(shown["pid"], w.pid, "show: {shown}");
}

#[test]
fn check_names_the_checkpoint_a_damaged_pack_breaks_and_gc_keeps_the_evidence() {
    skip_unless_ready!();
    let d = Daemon::start();
    let (id, _) = evicted_counter(&d, "checked");
    let clean = d.json(&["check", "--read-data", "--json"]);
    assert_eq!(clean["problems"].as_array().map(Vec::len), Some(0), "{clean}");
    assert!(clean["chunks_read"].as_u64().unwrap_or(0) > 0, "{clean}");
    let by_codec: u64 =
        clean["chunks_by_codec"].as_object().map_or(0, |m| m.values().filter_map(|n| n.as_u64()).sum());
    assert_eq!(
        by_codec,
        clean["chunks_read"].as_u64().unwrap_or(0),
        "every chunk read counted by codec: {clean}"
    );

    pack_files(&d).iter().for_each(|p| flip_byte_in_the_middle(p));
    // Sizes still add up: only reading the data finds a flipped byte.
    assert!(d.cli(&["check"]).status.success());
    for round in ["before gc", "after gc"] {
        let out = d.cli(&["check", "--read-data", "--json"]);
        assert_eq!(out.status.code(), Some(1), "{round}: a damaged store fails the check");
        let report: serde_json::Value = serde_json::from_slice(&out.stdout).expect("a JSON report");
        assert_eq!(report["broken"][0]["id"], id.as_str(), "{round}: {report}");
        let reasons = report["broken"][0]["reasons"].to_string();
        assert!(reasons.contains("is corrupt"), "{round}: {report}");
        d.json(&["gc", "--json"]);
    }
}
