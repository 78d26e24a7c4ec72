//! Encryption at rest: with a store key, nothing of a workload's memory or command line can be
//! found in the store's files (the same checkpoint in an unencrypted store shows both), the
//! checkpoint restores and verifies, a daemon without the key or with a wrong one refuses to
//! start saying so, and a rotated key opens the same checkpoints.

#![forbid(unsafe_code)]

use std::path::{Path, PathBuf};
use std::process::Command;
use std::time::Duration;

use stasis_tests::{
    Daemon, DaemonOptions, bin, expect_within, pid_of, procfs, python_workload, skip_unless_ready,
};

/// A string that appears nowhere unless this test's workload put it there.
fn marker() -> String {
    format!("STASIS-SECRET-{:08x}-MARKER", std::process::id())
}

fn key_file(dir: &Path, name: &str, byte: u8) -> PathBuf {
    let path = dir.join(name);
    std::fs::write(&path, hex_of(byte)).unwrap();
    path
}

fn hex_of(byte: u8) -> String {
    format!("{byte:02x}").repeat(32)
}

/// Whether any file under `dir` contains `needle`.
fn found_in(dir: &Path, needle: &[u8]) -> bool {
    let Ok(entries) = std::fs::read_dir(dir) else { return false };
    entries.flatten().any(|e| {
        let path = e.path();
        if path.is_dir() {
            return found_in(&path, needle);
        }
        std::fs::read(&path).is_ok_and(|data| data.windows(needle.len()).any(|w| w == needle))
    })
}

/// Evicts a secret holder to `d`'s store; returns its name and the digest it printed.
fn evict_secret(d: &Daemon) -> (String, String) {
    let w = d.run("secret", &python_workload("secret_holder.py", &[&marker()]));
    let (_, tick) = w.wait_line_after(0, "a tick", |l| l.starts_with("tick "));
    let digest = tick.split_whitespace().nth(2).unwrap().to_owned();
    d.json(&["checkpoint", "--workload", &w.name, "--json"]);
    procfs::wait_gone(w.pid, "the evicted workload to be gone");
    (w.name, digest)
}

/// Starts stasisd on `store` with `args` expecting it to refuse; returns what it said.
fn refused_start(dir: &Path, store: &str, args: &[&str]) -> String {
    let out = Command::new(bin("stasisd"))
        .arg("--socket")
        .arg(dir.join("refused.sock"))
        .arg("--state-dir")
        .arg(dir.join("refused-state"))
        .args(["--store", store])
        .args(args)
        .env_remove("STASIS_STORE_KEY")
        .output()
        .expect("starting stasisd");
    assert!(!out.status.success(), "stasisd should refuse to start with {args:?}");
    String::from_utf8_lossy(&out.stderr).into_owned()
}

#[test]
fn an_encrypted_store_holds_nothing_readable_and_needs_its_key() {
    skip_unless_ready!();
    let keys = tempfile::tempdir().unwrap();
    let (key, other) = (key_file(keys.path(), "key", 0x42), key_file(keys.path(), "other", 0x43));

    // The control: an unencrypted store shows the marker (memory) and the command line.
    let plain = Daemon::start();
    evict_secret(&plain);
    assert!(
        found_in(&plain.store_dir(), marker().as_bytes()),
        "the unencrypted store should show the marker"
    );

    let key_arg = |path: &Path| vec!["--store-key-file".to_string(), path.display().to_string()];
    let mut d = Daemon::start_with(&DaemonOptions { args: key_arg(&key), ..Default::default() });
    let (name, digest) = evict_secret(&d);
    let store = d.store_dir();
    assert!(!found_in(&store, marker().as_bytes()), "the encrypted store shows the marker");
    assert!(!found_in(&store, b"secret_holder"), "the encrypted store shows the command line");
    let checked = d.json(&["check", "--read-data", "--json"]);
    assert_eq!(checked["problems"].as_array().map(Vec::len), Some(0), "{checked}");
    d.stop();

    let url = format!("file://{}", store.display());
    let said = refused_start(keys.path(), &url, &[]);
    assert!(said.contains("is encrypted: give its key"), "{said}");
    let said = refused_start(keys.path(), &url, &["--store-key-file", &other.display().to_string()]);
    assert!(said.contains("wrong key"), "{said}");

    // Rotation: the other key now opens it; the first no longer does.
    let mut rotated = Daemon::start_with(&DaemonOptions {
        store: Some(url.clone()),
        args: [key_arg(&other), vec!["--rotate-store-key-from".into(), key.display().to_string()]].concat(),
        ..Default::default()
    });
    rotated.stop();
    let said = refused_start(keys.path(), &url, &["--store-key-file", &key.display().to_string()]);
    assert!(said.contains("wrong key"), "{said}");

    let after =
        Daemon::start_with(&DaemonOptions { store: Some(url), args: key_arg(&other), ..Default::default() });
    // Lazily (memory fetched and opened as it is touched), then, evicted again, eagerly.
    for how in [&["--lazy"][..], &[]] {
        let mut args = vec!["restore", "--workload", &name, "--json"];
        args.extend(how);
        let restored = after.json(&args);
        let pid = pid_of(&restored);
        assert!(
            procfs::is_namespace_init(pid),
            "the restored tree has a pid namespace of its own: {restored}"
        );
        // Its output goes to the restoring daemon's log of it.
        let log = after.dir().join("state/logs").join(format!("{name}.log"));
        let seen = std::fs::read_to_string(&log).unwrap_or_default().lines().count();
        expect_within(Duration::from_secs(30), "new ticks with the same memory after the restore", || {
            let text = std::fs::read_to_string(&log).ok()?;
            let fresh: Vec<&str> = text.lines().skip(seen).filter(|l| l.starts_with("tick ")).collect();
            (fresh.len() >= 12 && fresh.iter().all(|l| l.ends_with(&digest))).then_some(())
        });
        after.json(&["checkpoint", "--workload", &name, "--json"]);
        procfs::wait_gone(pid, "the evicted workload to be gone");
    }
}
