//! The content-addressed store: a second checkpoint uploads about what changed, every
//! checkpoint restores by itself (the first after the second exists, the second after the first
//! is deleted), and garbage collection reclaims dead data without breaking a live checkpoint.
//! A store whose compression changes between checkpoints restores each as it was written.

#![forbid(unsafe_code)]

use std::collections::BTreeMap;
use std::path::Path;

use nix::sys::signal::Signal;
use stasis_proto::stasis::store::v1::{Codec, PackIndex};
use stasis_store::envelope;
use stasis_tests::{Daemon, DaemonOptions, Workload, procfs, python_workload, skip_unless_ready};

fn daemon() -> Daemon {
    let args = ["--gc-grace-secs", "0", "--keep-last", "0"].map(String::from).to_vec();
    Daemon::start_with(&DaemonOptions { args, ..Default::default() })
}

fn dirty(w: &Workload) {
    let skip = w.lines().len();
    procfs::signal(w.pid, Signal::SIGUSR1);
    w.wait_line_after(skip, "`dirtied`", |l| l == "dirtied");
}

fn kill_and_wait(pid: i32) {
    procfs::kill9(pid);
    procfs::wait_gone(pid, "the killed workload to be gone");
}

fn stat(ck: &serde_json::Value, key: &str) -> u64 {
    ck["stats"][key].as_u64().unwrap_or_else(|| panic!("no stats.{key} in {ck}"))
}

fn restore_and_check(d: &Daemon, w: &mut Workload, id: &str, expected: &str) {
    let r = d.json(&["restore", id, "--json"]);
    w.restored(&r);
    assert_eq!(w.memhog_checksum(), expected, "memory of checkpoint {id} after restore");
}

#[test]
fn second_checkpoint_uploads_what_changed_and_each_restores_alone() {
    skip_unless_ready!();
    let d = daemon();
    let mut w = d.run("memhog", &python_workload("memhog.py", &[]));
    w.wait_line_after(0, "`ready`", |l| l == "ready");

    let c1 = w.memhog_checksum();
    let ck1 = d.json(&["checkpoint", "--workload", &w.name, "--leave-running", "--json"]);
    dirty(&w);
    let c2 = w.memhog_checksum();
    assert_ne!(c1, c2, "dirtying changed the memory");
    let ck2 = d.json(&["checkpoint", "--workload", &w.name, "--leave-running", "--json"]);

    let (up1, up2) = (stat(&ck1, "bytes_uploaded"), stat(&ck2, "bytes_uploaded"));
    assert!(up1 >= 60 << 20, "the first checkpoint uploads the 64 MiB of random memory: {ck1}");
    // 4 MiB were rewritten; the rest is referenced, not uploaded again.
    assert!(up2 * 4 <= up1, "second upload {up2} is not small against the first {up1}: {ck2}");
    assert!(stat(&ck2, "chunks_new") * 4 < stat(&ck2, "chunks_total"), "{ck2}");

    let id1 = ck1["id"].as_str().unwrap().to_owned();
    let id2 = ck2["id"].as_str().unwrap().to_owned();
    kill_and_wait(w.pid);
    restore_and_check(&d, &mut w, &id1, &c1);
    kill_and_wait(w.pid);
    restore_and_check(&d, &mut w, &id2, &c2);

    // Delete the first and collect garbage: the second does not depend on it.
    kill_and_wait(w.pid);
    d.ok(&["delete", &id1]);
    d.json(&["gc", "--json"]);
    restore_and_check(&d, &mut w, &id2, &c2);
}

#[test]
fn a_checkpoint_after_heap_churn_uploads_what_was_written_not_what_moved() {
    skip_unless_ready!();
    let d = daemon();
    let mut w = d.run("churn", &python_workload("heap_churn.py", &["256"]));
    w.wait_line_after(0, "`ready`", |l| l == "ready");
    let ck1 = d.json(&["checkpoint", "--workload", &w.name, "--leave-running", "--json"]);
    let skip = w.lines().len();
    procfs::signal(w.pid, Signal::SIGUSR1);
    let (_, line) = w.wait_line_after(skip, "`dirtied W`", |l| l.starts_with("dirtied "));
    let written: u64 = line["dirtied ".len()..].parse::<u64>().expect("a window count") << 16;
    let c2 = w.memhog_checksum();
    let ck2 = d.json(&["checkpoint", "--workload", &w.name, "--leave-running", "--json"]);
    let up2 = stat(&ck2, "bytes_uploaded");
    eprintln!(
        "written {written}, uploaded {up2} ({:.2}x); first upload {}",
        up2 as f64 / written as f64,
        stat(&ck1, "bytes_uploaded")
    );
    // Random bytes do not compress: what is uploaded is what changed, plus images and indexes.
    assert!(up2 <= written * 11 / 10 + (1 << 20), "uploaded {up2} for {written} written: {ck2}");
    kill_and_wait(w.pid);
    restore_and_check(&d, &mut w, ck2["id"].as_str().unwrap(), &c2);
}

#[test]
fn gc_reclaims_dead_checkpoints_and_keeps_live_ones() {
    skip_unless_ready!();
    let d = daemon();
    let mut live = d.run("live", &python_workload("memhog.py", &[]));
    let dead = d.run("dead", &python_workload("memhog.py", &[]));
    for w in [&live, &dead] {
        w.wait_line_after(0, "`ready`", |l| l == "ready");
    }
    let live_sum = live.memhog_checksum();
    let live_ck = d.json(&["checkpoint", "--workload", &live.name, "--json"]);
    let dead_ck = d.json(&["checkpoint", "--workload", &dead.name, "--json"]);
    let packs = || std::fs::read_dir(d.store_dir().join("packs")).map(|r| r.count()).unwrap_or(0);
    let before = packs();

    d.ok(&["delete", dead_ck["id"].as_str().unwrap()]);
    let report = d.json(&["gc", "--json"]);
    assert!(report["bytes_freed"].as_u64().unwrap() >= 60 << 20, "the dead 64 MiB are reclaimed: {report}");
    assert!(packs() < before, "pack objects were deleted: {report}");

    procfs::wait_gone(live.pid, "the evicted workload to be gone");
    restore_and_check(&d, &mut live, live_ck["id"].as_str().unwrap(), &live_sum);

    // Retention: three checkpoints, keep the newest one.
    let more: Vec<String> = (0..2)
        .map(|_| {
            let ck = d.json(&["checkpoint", "--workload", &live.name, "--leave-running", "--json"]);
            ck["id"].as_str().unwrap().to_owned()
        })
        .collect();
    let report = d.json(&["gc", "--keep-last", "1", "--json"]);
    let deleted: Vec<&str> =
        report["checkpoints_deleted"].as_array().unwrap().iter().filter_map(|v| v.as_str()).collect();
    assert_eq!(deleted, [live_ck["id"].as_str().unwrap(), more[0].as_str()], "{report}");
    kill_and_wait(live.pid);
    restore_and_check(&d, &mut live, &more[1], &live_sum);
}

#[test]
fn pages_beyond_the_staging_bound_spill_and_restore_intact() {
    skip_unless_ready!();
    let args = ["--staging-mib", "8"].map(String::from).to_vec();
    let d = Daemon::start_with(&DaemonOptions { args, ..Default::default() });
    let mut w = d.run("spill", &python_workload("memhog.py", &[]));
    w.wait_line_after(0, "`ready`", |l| l == "ready");
    let sum = w.memhog_checksum();
    let ck = d.json(&["checkpoint", "--workload", &w.name, "--json"]);
    // 64 MiB of random memory plus the interpreter; the spill file itself is not a CRIU image.
    assert!(stat(&ck, "bytes_uploaded") < 100 << 20, "the upload is inflated: {ck}");
    let id = ck["id"].as_str().unwrap();
    let shown = d.json(&["show", id, "--json"]);
    assert!(!shown["files"].to_string().contains("spill"), "{shown}");
    procfs::wait_gone(w.pid, "the evicted workload to be gone");
    restore_and_check(&d, &mut w, id, &sum);
}

/// How many chunks the file store at `store` holds with each codec.
fn codecs(store: &Path) -> BTreeMap<Codec, usize> {
    let mut count = BTreeMap::new();
    for entry in std::fs::read_dir(store.join("packs")).expect("the store's packs") {
        let path = entry.unwrap().path();
        if path.extension().is_some_and(|e| e == "idx") {
            let bytes = std::fs::read(&path).unwrap();
            let index: PackIndex = envelope::decode(envelope::PACK_INDEX, &bytes, None).unwrap();
            for e in index.entries {
                *count.entry(Codec::try_from(e.codec).unwrap()).or_default() += 1;
            }
        }
    }
    count
}

#[test]
fn checkpoints_written_with_zstd_and_with_lz4_each_restore_from_one_store() {
    skip_unless_ready!();
    let mut d = daemon();
    // 64 MiB of random memory, no zeros, 16 MiB of text: a table, a tokenizer's vocabulary.
    let mut w = d.run("codecs", &python_workload("memhog.py", &["64", "0", "16"]));
    w.wait_line_after(0, "`ready`", |l| l == "ready");
    let c1 = w.memhog_checksum();
    let ck1 = d.json(&["checkpoint", "--workload", &w.name, "--leave-running", "--json"]);
    assert_eq!(d.json(&["status", "--json"])["compression"], "zstd");
    let zstd_only = codecs(&d.store_dir());
    assert!(
        zstd_only.get(&Codec::Zstd).is_some_and(|&n| n > 0) && !zstd_only.contains_key(&Codec::Lz4),
        "{zstd_only:?}"
    );

    d.kill9_and_restart_with(&["--gc-grace-secs", "0", "--keep-last", "0", "--compression", "lz4"]);
    assert_eq!(d.json(&["status", "--json"])["compression"], "lz4");
    dirty(&w);
    let c2 = w.memhog_checksum();
    let ck2 = d.json(&["checkpoint", "--workload", &w.name, "--json"]);
    let both = codecs(&d.store_dir());
    assert!(both.get(&Codec::Lz4).is_some_and(|&n| n > 0), "the second checkpoint's chunks: {both:?}");
    assert_eq!(both.get(&Codec::Zstd), zstd_only.get(&Codec::Zstd), "the first checkpoint's chunks stay");
    let report = d.json(&["check", "--read-data", "--json"]);
    assert_eq!(report["problems"], serde_json::json!([]), "{report}");

    let (id1, id2) = (ck1["id"].as_str().unwrap().to_owned(), ck2["id"].as_str().unwrap().to_owned());
    procfs::wait_gone(w.pid, "the evicted workload to be gone");
    restore_and_check(&d, &mut w, &id2, &c2);
    kill_and_wait(w.pid);
    restore_and_check(&d, &mut w, &id1, &c1);
}
