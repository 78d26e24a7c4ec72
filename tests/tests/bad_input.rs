//! Wrong pids, unknown or malformed ids, and damaged checkpoints in the store: each is a
//! clean error (exit status 1, `error: ...` saying what is wrong), and the daemon keeps
//! serving. One daemon for all of them, in sequence.

#![forbid(unsafe_code)]

use std::fs::OpenOptions;
use std::path::Path;

use stasis_tests::{Daemon, TIMEOUT, expect_within, procfs, python_workload, skip_unless_ready};

/// `status --json` still answers.
fn still_serving(d: &Daemon, after: &str) {
    let out = d.cli(&["status", "--json"]);
    assert!(
        out.status.success(),
        "stasisd stopped serving after {after}: {}\n{}",
        String::from_utf8_lossy(&out.stderr),
        d.log_tail(40)
    );
}

fn assert_mentions(stderr: &str, any_of: &[&str], what: &str) {
    let lower = stderr.to_lowercase();
    assert!(
        any_of.iter().any(|needle| lower.contains(needle)),
        "{what}: the error should mention one of {any_of:?}, got:\n{stderr}"
    );
}

/// Runs a counter and checkpoints it (evicting it); returns (checkpoint id, pid).
fn evicted_counter(d: &Daemon, base: &str) -> (String, i32) {
    let w = d.run(base, &python_workload("counter.py", &[]));
    w.wait_number("count ", 5);
    let ck = d.json(&["checkpoint", "--workload", &w.name, "--json"]);
    expect_within(TIMEOUT, "the evicted counter to be gone", || (!procfs::exists(w.pid)).then_some(()));
    (ck["id"].as_str().expect("checkpoint id").to_owned(), w.pid)
}

fn flip_byte_in_the_middle(path: &Path) {
    let mut bytes = std::fs::read(path).unwrap_or_else(|e| panic!("{}: {e}", path.display()));
    assert!(bytes.len() > 16, "{} is suspiciously small", path.display());
    let middle = bytes.len() / 2;
    bytes[middle] ^= 0x01;
    std::fs::write(path, bytes).unwrap();
}

/// Something done to a pack file.
type Damage = fn(&Path);

/// The pack data files of the daemon's store.
fn pack_files(d: &Daemon) -> Vec<std::path::PathBuf> {
    let dir = d.store_dir().join("packs");
    let Ok(entries) = std::fs::read_dir(&dir) else { return Vec::new() };
    entries.map(|e| e.unwrap().path()).filter(|p| p.extension().is_some_and(|x| x == "pack")).collect()
}

fn truncate_by_one(path: &Path) {
    let file =
        OpenOptions::new().write(true).open(path).unwrap_or_else(|e| panic!("{}: {e}", path.display()));
    let len = file.metadata().unwrap().len();
    assert!(len > 0, "{} is empty", path.display());
    file.set_len(len - 1).unwrap();
}

#[test]
fn bad_input_is_a_clean_error_and_the_daemon_keeps_serving() {
    skip_unless_ready!();
    let d = Daemon::start();

    // A pid that does not exist.
    let missing_pid = 4_000_000;
    assert!(!procfs::exists(missing_pid));
    let err = d.cli_err(&["checkpoint", &missing_pid.to_string(), "--json"]);
    assert_mentions(&err, &["does not exist"], "checkpoint of a missing pid");
    still_serving(&d, "checkpoint of a missing pid");

    // A well-formed id that is not in the store.
    let err = d.cli_err(&["restore", "20200101-000000-abcdef", "--json"]);
    assert_mentions(&err, &["not found"], "restore of an unknown id");
    still_serving(&d, "restore of an unknown id");
    let err = d.cli_err(&["show", "20200101-000000-abcdef", "--json"]);
    assert_mentions(&err, &["not found"], "show of an unknown id");

    // Malformed ids never reach the store (and never escape it).
    let canary = d.dir().join("etc");
    std::fs::create_dir(&canary).unwrap();
    std::fs::write(canary.join("keep"), "x").unwrap();
    for args in
        [&["restore", "../../etc", "--json"][..], &["show", "../../etc", "--json"], &["delete", "../../etc"]]
    {
        let err = d.cli_err(args);
        assert_mentions(&err, &["not a checkpoint id"], &format!("`stasis {}`", args.join(" ")));
        still_serving(&d, &format!("`stasis {}`", args.join(" ")));
    }
    assert!(canary.join("keep").exists(), "delete ../../etc removed something outside the store");

    // A manifest with one byte flipped: restore and show refuse it.
    let (flipped, flipped_pid) = evicted_counter(&d, "flipped");
    let manifest = d.store_dir().join("manifests").join(format!("{flipped}.manifest"));
    flip_byte_in_the_middle(&manifest);
    let err = d.cli_err(&["restore", &flipped, "--json"]);
    assert_mentions(&err, &["corrupted", "checksum"], "restore of a flipped manifest");
    assert!(!procfs::alive(flipped_pid), "a refused restore must not start anything");
    still_serving(&d, "restore of a flipped manifest");
    let err = d.cli_err(&["show", &flipped, "--json"]);
    assert_mentions(&err, &["corrupted", "checksum"], "show of a flipped manifest");
    still_serving(&d, "show of a flipped manifest");

    // Damaged packs: a flipped byte, a lost last byte, a deleted pack. Each case gets a store of
    // its own: checkpoints share chunks, so damage to one pack shows in every checkpoint that
    // references a chunk in it, whichever is read first.
    let damages: [(&str, Damage, &[&str]); 3] = [
        ("corrupt", flip_byte_in_the_middle, &["corrupted"]),
        ("truncated", truncate_by_one, &["truncated"]),
        ("missing", |p: &Path| std::fs::remove_file(p).unwrap(), &["missing"]),
    ];
    for (base, damage, expected) in damages {
        let d = Daemon::start();
        let before = pack_files(&d);
        let (id, pid) = evicted_counter(&d, base);
        let fresh: Vec<_> = pack_files(&d).into_iter().filter(|p| !before.contains(p)).collect();
        assert!(!fresh.is_empty(), "checkpoint {id} wrote no pack");
        fresh.iter().for_each(|p| damage(p));
        let err = d.cli_err(&["restore", &id, "--json"]);
        assert_mentions(&err, expected, &format!("restore of a checkpoint with a {base} pack"));
        assert_mentions(&err, &[&id], "the error names the checkpoint");
        assert!(
            !procfs::alive(pid),
            "a failed restore must not leave a (half-)restored process {pid} behind"
        );
        still_serving(&d, &format!("restore with a {base} pack"));
        // Its manifest is intact, so show works; the damage is found when the data is read.
        let shown = d.json(&["show", &id, "--json"]);
        assert_eq!(shown["id"], id.as_str());
    }

    // One damaged checkpoint does not break listing the store.
    d.json(&["list", "--json"]);
}
