//! A real server from Debian's packages: `redis-server` holding about 300 MB, checkpointed and
//! restored. The data comes back whole (redis's digest of the dataset, a sample of values, a
//! few MiB of incompressible ones), the listener takes new connections, and a client connection
//! from outside the checkpointed tree survives an eviction: CRIU restores the established TCP
//! connection. Then `--leave-running`: redis answers all through the dump, and after a kill -9
//! the checkpoint restores the state redis had when it was taken, not the one it had later.

#![forbid(unsafe_code)]

use std::time::Instant;

use serde_json::Value;
use stasis_tests::resp::{self, Client, Reply, status};
use stasis_tests::{Daemon, TIMEOUT, expect_within, procfs, skip_unless_ready};

/// Keys `DEBUG POPULATE` creates, 1000 bytes each.
const KEYS: u64 = 300_000;
/// Populated keys overwritten with 256 KiB of pseudo-random bytes each.
const DISTINCT: u64 = 16;

/// The 256 KiB value of distinctive key `i`: pseudo-random, so no store compresses it.
fn distinct_value(i: u64) -> Vec<u8> {
    stasis_tests::noise(i, 256 << 10)
}

/// What must survive: the key count, redis's digest of the whole dataset, and 1000 populated
/// values plus the distinctive ones, read back in one MGET (a reply of about 5 MiB).
#[derive(Debug, PartialEq, Eq)]
struct Data {
    keys: Reply,
    digest: Reply,
    sample_hash: u64,
}

fn data(c: &mut Client) -> Data {
    use std::hash::{DefaultHasher, Hash, Hasher};
    let keys = (0..DISTINCT).chain((0..1000).map(|i| (i * 7919 + 4243) % KEYS)).map(|k| format!("key:{k}"));
    let mut mget = vec!["MGET".to_owned()];
    mget.extend(keys);
    let Reply::Array(values) = c.call(&mget.iter().map(String::as_bytes).collect::<Vec<_>>()) else {
        panic!("MGET did not answer an array")
    };
    for i in 0..DISTINCT {
        assert!(values[i as usize] == Reply::Bulk(Some(distinct_value(i))), "key:{i} lost its value");
    }
    assert!(values.iter().all(|v| matches!(v, Reply::Bulk(Some(_)))), "a sampled key is missing");
    let mut hasher = DefaultHasher::new();
    values.hash(&mut hasher);
    Data { keys: c.cmd("DBSIZE"), digest: c.cmd("DEBUG DIGEST"), sample_hash: hasher.finish() }
}

/// Kills redis when the test ends, passed or not: redis rewrites its process title, so the
/// harness, which only kills processes still showing their workload's command, would miss it.
struct KillOnDrop(i32);

impl Drop for KillOnDrop {
    fn drop(&mut self) {
        procfs::kill9(self.0);
    }
}

/// Debian's `/usr/bin/redis-server` (or the first on `PATH`); scripts/test.sh installs it.
fn redis_server() -> String {
    resp::redis_server()
        .expect("redis-server is not installed: run scripts/test.sh, or apt-get install redis-server")
}

fn stats(result: &Value) -> String {
    result["stats"].to_string()
}

#[test]
fn redis_with_300_mb_survives_eviction_and_leave_running_checkpoints() {
    skip_unless_ready!();
    let redis = redis_server();
    let port = stasis_tests::free_port();
    let d = Daemon::start();
    let port_arg = port.to_string();
    let argv: Vec<String> = [&redis, "--port", &port_arg, "--bind", "127.0.0.1", "--save", ""]
        .into_iter()
        .chain(["--appendonly", "no", "--daemonize", "no", "--enable-debug-command", "local"])
        .map(str::to_owned)
        .collect();
    let mut w = d.run("redis", &argv);
    let _reaper = KillOnDrop(w.pid);
    let mut kept = expect_within(TIMEOUT, &format!("redis to answer PING on port {port}"), || {
        let mut c = Client::connect(port).ok()?;
        (c.try_call(&[b"PING"]).ok()? == status("PONG")).then_some(c)
    });

    assert_eq!(kept.cmd(&format!("DEBUG POPULATE {KEYS} key 1000")), status("OK"));
    assert_eq!(kept.cmd("DBSIZE"), Reply::Int(KEYS as i64));
    for i in 0..DISTINCT {
        assert_eq!(kept.call(&[b"SET", format!("key:{i}").as_bytes(), &distinct_value(i)]), status("OK"));
    }
    let before = data(&mut kept);
    assert_eq!(before.keys, Reply::Int(KEYS as i64));

    // Eviction, with `kept` connected (its peer, this test, is outside the checkpointed tree).
    let started = Instant::now();
    let ck = d.json(&["checkpoint", "--workload", &w.name, "--json"]);
    eprintln!("eviction took {:?}: {}", started.elapsed(), stats(&ck));
    procfs::wait_gone(w.pid, "redis to be gone after the eviction");
    let started = Instant::now();
    let r = d.json(&["restore", "--workload", &w.name, "--json"]);
    eprintln!("restore took {:?}: {r}", started.elapsed());
    w.restored(&r);
    assert_eq!(data(&mut kept), before, "on the connection kept open across eviction and restore");
    let mut fresh = Client::connect(port).expect("a new connection to the restored redis");
    assert_eq!(data(&mut fresh), before, "on a new connection to the restored redis");
    drop(fresh);

    // --leave-running: redis answers `kept` all through the dump.
    let (ck, _) = d.checkpoint_while(&w.name, || {
        assert_eq!(kept.cmd("PING"), status("PONG"), "during checkpoint --leave-running");
    });
    eprintln!("checkpoint --leave-running: {}", stats(&ck));
    assert_eq!(ck["left_running"], true, "checkpoint result: {ck}");
    let id = ck["id"].as_str().expect("checkpoint id").to_owned();
    assert!(procfs::running(w.pid), "redis after the checkpoint: state {:?}", procfs::proc_state(w.pid));
    assert_eq!(data(&mut kept), before, "after checkpoint --leave-running");
    // Changes after the checkpoint must not come back.
    assert_eq!(kept.cmd("FLUSHALL"), status("OK"));
    assert_eq!(kept.cmd("DBSIZE"), Reply::Int(0));
    // The client leaves first, so that no half-closed connection of redis's lingers on its port.
    drop(kept);
    procfs::kill9(w.pid);
    procfs::wait_gone(w.pid, "the killed redis to be reaped");

    let started = Instant::now();
    let r = d.json(&["restore", &id, "--json"]);
    eprintln!("restore of the --leave-running checkpoint took {:?}: {r}", started.elapsed());
    w.restored(&r);
    let mut fresh = Client::connect(port).expect("a new connection to the restored redis");
    assert_eq!(data(&mut fresh), before, "after restoring the --leave-running checkpoint");
}
