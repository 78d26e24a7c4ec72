//! Each cloud store through its emulator on loopback: S3 (moto's server), Azure Blob Storage
//! (Azurite) and GCS (fake-gcs-server, with our fixture for the XML uploads it lacks; see
//! stasis_tests::gcs). The same life for each: a counter evicted and restored, evicted again
//! and restored lazily, counting on from where it was each time; the store checked, data read
//! back; collected, keeping the last checkpoint whole; then the store dies in the middle of an
//! eviction's upload: the eviction fails saying so, the counter runs on with its memory, and
//! once the store is back it is evicted and restored again.

#![forbid(unsafe_code)]

use stasis_tests::azurite::Azurite;
use stasis_tests::gcs::GcsServer;
use stasis_tests::http_faults::{Fault, FaultyHttp, Rule};
use stasis_tests::s3::S3Server;
use stasis_tests::{Daemon, DaemonOptions, Workload, procfs, python_workload, skip_unless_ready};

/// stasisd's options for reaching the store through a relay on a port.
type Through<'a> = &'a dyn Fn(u16, &[&str]) -> DaemonOptions;

#[test]
fn s3_through_moto() {
    skip_unless_ready!();
    let Some(s3) = S3Server::start() else { return };
    life_of_a_counter(s3.port, &|port, args| s3.daemon_options_at(port, "life", args));
}

#[test]
fn azure_through_azurite() {
    skip_unless_ready!();
    let Some(azurite) = Azurite::start() else { return };
    life_of_a_counter(azurite.port, &|port, args| azurite.daemon_options_at(port, "life", args));
}

#[test]
fn gcs_through_fake_gcs_server() {
    skip_unless_ready!();
    let Some(gcs) = GcsServer::start() else { return };
    life_of_a_counter(gcs.port, &|port, args| gcs.daemon_options_at(port, "life", args));
}

/// The counter's life on the store at `port`, reached through a relay that can kill it.
fn life_of_a_counter(port: u16, options: Through) {
    let relay = FaultyHttp::start(port);
    // A store that dies fails a request within 5 s (a live one answers well within that on a
    // loaded machine); collection takes at once what no checkpoint keeps.
    let d = Daemon::start_with(&options(relay.port, &["--store-retry-secs", "5", "--gc-grace-secs", "0"]));
    let mut w = d.run("counter", &python_workload("counter.py", &[]));
    w.wait_number("count ", 5);

    let (first, uploaded, counted) = evict(&d, &w);
    w.restored(&d.json(&["restore", &first, "--json"]));
    counts_on(&w, counted);

    let (second, again, counted) = evict(&d, &w);
    assert!(again * 2 < uploaded, "the second checkpoint is incremental: {again} bytes after {uploaded}");
    let lazy = d.json(&["restore", &second, "--lazy", "--json"]);
    assert_eq!(lazy["stats"]["lazy"], true, "{lazy}");
    assert!(lazy["stats"]["bytes_fetched"].as_u64() > Some(0), "{lazy}");
    w.restored(&lazy);
    counts_on(&w, counted);

    clean(&d, "after two checkpoints");
    let collected = d.json(&["gc", "--keep-last", "1", "--json"]);
    assert_eq!(collected["checkpoints_deleted"], serde_json::json!([first]), "{collected}");
    let listed = d.json(&["list", "--json"]);
    let ids: Vec<&str> =
        listed["checkpoints"].as_array().unwrap().iter().filter_map(|c| c["id"].as_str()).collect();
    assert_eq!(ids, [second.as_str()], "{listed}");
    clean(&d, "after the collection");

    // The store dies while the first pack of an eviction is on its way (GCS's paths are
    // percent-encoded: `packs%2F`).
    relay.set(Some(Rule { method: "PUT", path: "packs", fault: Fault::Die }));
    let before = w.last_number("count ").unwrap();
    let err = d.cli_err(&["checkpoint", "--workload", &w.name]);
    for says in ["storing checkpoint", "the workload was resumed", "packs/"] {
        assert!(err.contains(says), "the error should say {says:?}: {err}");
    }
    assert_eq!(procfs::proc_state(w.pid).map(|s| s != 'T'), Some(true), "the counter runs on: {err}");
    // Its memory is its own: it counts on from where it was, one by one.
    counts_on(&w, before + 10);

    // Back up, the store takes the eviction, and the counter comes back from it.
    relay.set(None);
    let (third, _, counted) = evict(&d, &w);
    w.restored(&d.json(&["restore", &third, "--json"]));
    counts_on(&w, counted);
    clean(&d, "after the store came back");
}

/// Evicts counter `w`: its checkpoint's id, the bytes uploaded, and its last count, once the
/// tree is gone.
fn evict(d: &Daemon, w: &Workload) -> (String, u64, u64) {
    let ck = d.json(&["checkpoint", "--workload", &w.name, "--json"]);
    procfs::wait_gone(w.pid, "the evicted counter to be gone");
    let uploaded = ck["stats"]["bytes_uploaded"].as_u64().unwrap();
    assert!(uploaded > 0, "{ck}");
    (ck["id"].as_str().unwrap().to_owned(), uploaded, w.last_number("count ").unwrap())
}

/// Waits for counter `w` to count past `at`, and checks that it counted on from where it was
/// each time: its log counts 1, 2, 3, ... without a gap, a repeat or a new start.
fn counts_on(w: &Workload, at: u64) {
    w.wait_number("count ", at + 2);
    let counts = w.numbers("count ");
    let off = counts.iter().zip(1..).find(|(n, i)| *n != i);
    assert_eq!(off, None, "the counter did not count on from where it was: {counts:?}");
}

/// `stasis check --read-data` finds every checkpoint whole, reading its data back.
fn clean(d: &Daemon, when: &str) {
    let checked = d.json(&["check", "--read-data", "--json"]);
    assert_eq!(checked["problems"].as_array().map(Vec::len), Some(0), "{when}: {checked}");
    assert!(checked["chunks_read"].as_u64() > Some(0), "{when}: {checked}");
}
