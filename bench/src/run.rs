//! One benchmark run: a stasisd, the workload, two checkpoints each way, two restores.

use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant};

use anyhow::{Context, bail};
use nix::sys::signal::{Signal, kill};
use nix::unistd::Pid;
use serde_json::Value;

use crate::Args;
use crate::peer::{Peer, PeerCheckpoint};

/// Everything measured.
pub struct Results {
    ck1: Value,
    ck2: Value,
    dirtied: u64,
    peer1: PeerCheckpoint,
    peer2: PeerCheckpoint,
    stasis_restore: Duration,
    peer_restore: Duration,
    peak_rss: u64,
    staging_bound: u64,
}

/// Kills what the run started, also when it fails half-way.
struct Session {
    daemon: Child,
    socket: PathBuf,
    work: PathBuf,
    scratch: PathBuf,
    pid: Option<i32>,
}

impl Drop for Session {
    fn drop(&mut self) {
        if let Some(pid) = self.pid {
            let _ = kill(Pid::from_raw(pid), Signal::SIGKILL);
        }
        let _ = kill(Pid::from_raw(self.daemon.id() as i32), Signal::SIGTERM);
        let _ = self.daemon.wait();
        let _ = std::fs::remove_dir_all(&self.work);
        let _ = std::fs::remove_dir_all(&self.scratch);
    }
}

impl Session {
    fn stasis(&self, args: &[&str]) -> anyhow::Result<Value> {
        let out =
            Command::new("target/release/stasis").arg("--socket").arg(&self.socket).args(args).output()?;
        if !out.status.success() {
            bail!("stasis {}: {}", args.join(" "), String::from_utf8_lossy(&out.stderr));
        }
        serde_json::from_slice(&out.stdout)
            .with_context(|| format!("stasis {} printed no JSON", args.join(" ")))
    }
}

fn wait_until(what: &str, timeout: Duration, mut done: impl FnMut() -> bool) -> anyhow::Result<()> {
    let deadline = Instant::now() + timeout;
    while !done() {
        if Instant::now() > deadline {
            bail!("timed out waiting for {what}");
        }
        std::thread::sleep(Duration::from_millis(20));
    }
    Ok(())
}

fn log_line(log: &Path, prefix: &str) -> Option<String> {
    std::fs::read_to_string(log).ok()?.lines().find(|l| l.starts_with(prefix)).map(str::to_string)
}

fn kill_and_wait(pid: i32) -> anyhow::Result<()> {
    let _ = kill(Pid::from_raw(pid), Signal::SIGKILL);
    wait_until("the workload to exit", Duration::from_secs(30), || {
        !Path::new(&format!("/proc/{pid}")).exists()
    })
}

fn peak_rss(pid: u32) -> u64 {
    let status = std::fs::read_to_string(format!("/proc/{pid}/status")).unwrap_or_default();
    let kib = status
        .lines()
        .find_map(|l| l.strip_prefix("VmHWM:"))
        .and_then(|v| v.split_whitespace().next()?.parse().ok());
    kib.unwrap_or(0u64) * 1024
}

pub fn run(args: &Args) -> anyhow::Result<Results> {
    let criu = std::fs::canonicalize(".stasis/criu/bin/criu").context("run scripts/setup-criu.sh first")?;
    let work = args.store_dir.join(format!("run-{}", std::process::id()));
    let scratch = PathBuf::from(format!("/dev/shm/stasis-bench-{}", std::process::id()));
    std::fs::create_dir_all(&work)?;
    let socket = work.join("stasisd.sock");
    let mut cmd = Command::new("target/release/stasisd");
    cmd.arg("--socket").arg(&socket).arg("--state-dir").arg(work.join("state"));
    cmd.arg("--store").arg(format!("file://{}", work.join("store").display())).arg("--criu").arg(&criu);
    cmd.args(["--keep-last", "0"]);
    if let Some(mib) = args.staging_mib {
        cmd.arg("--staging-mib").arg(mib.to_string());
    }
    let log = std::fs::File::create(work.join("stasisd.log"))?;
    let daemon =
        cmd.stdin(Stdio::null()).stdout(log.try_clone()?).stderr(log).spawn().context("starting stasisd")?;
    let mut s = Session { daemon, socket, work: work.clone(), scratch: scratch.clone(), pid: None };
    wait_until("stasisd", Duration::from_secs(30), || s.stasis(&["status", "--json"]).is_ok())?;
    let staging_bound = args.staging_mib.map(|m| m << 20).unwrap_or_else(|| {
        let mem = std::fs::read_to_string("/proc/meminfo").unwrap_or_default();
        let kib: u64 = mem
            .lines()
            .find_map(|l| l.strip_prefix("MemTotal:")?.split_whitespace().next()?.parse().ok())
            .unwrap_or(0);
        kib * 1024 / 4
    });

    let workload = std::fs::canonicalize("target/release/stasis-bench-workload")?;
    let f = |x: f64| x.to_string();
    let run = s.stasis(&[
        "run",
        "--workload",
        "bench",
        "--json",
        "--",
        &workload.display().to_string(),
        "--rss-mib",
        &args.rss_mib.to_string(),
        "--random",
        &f(args.random),
        "--compressible",
        &f(args.compressible),
        "--dirty",
        &f(args.dirty),
    ])?;
    let pid = run["pid"].as_i64().context("no pid")? as i32;
    s.pid = Some(pid);
    let wlog = PathBuf::from(run["log"].as_str().context("no log")?);
    wait_until("the workload", Duration::from_secs(300), || log_line(&wlog, "ready").is_some())?;

    let peer = Peer { criu, scratch, store: work.join("store").join("peer") };
    let ck1 = s.stasis(&["checkpoint", "--workload", "bench", "--leave-running", "--json"])?;
    let peer1 = peer.checkpoint(pid, "ck1")?;
    kill(Pid::from_raw(pid), Signal::SIGUSR1)?;
    wait_until("dirtying", Duration::from_secs(60), || log_line(&wlog, "dirtied").is_some())?;
    let dirtied: u64 =
        log_line(&wlog, "dirtied").and_then(|l| l.split_whitespace().nth(1)?.parse().ok()).unwrap_or(0);
    let ck2 = s.stasis(&["checkpoint", "--workload", "bench", "--leave-running", "--json"])?;
    let peer2 = peer.checkpoint(pid, "ck2")?;

    kill_and_wait(pid)?;
    let started = Instant::now();
    s.stasis(&["restore", ck2["id"].as_str().context("no id")?, "--json"])?;
    let stasis_restore = started.elapsed();
    kill_and_wait(pid)?;
    let peer_restore = peer.restore(&peer2.tarball)?;
    kill_and_wait(pid)?;
    s.pid = None;
    let peak_rss = peak_rss(s.daemon.id());
    Ok(Results { ck1, ck2, dirtied, peer1, peer2, stasis_restore, peer_restore, peak_rss, staging_bound })
}

/// Slack allowed over the staging bound: the daemon itself, pack buffers, in-flight uploads.
const RSS_SLACK: u64 = 256 << 20;

impl Results {
    pub fn table(&self, args: &Args) -> String {
        let st = |ck: &Value, k: &str| ck["stats"][k].as_u64().unwrap_or(0) as f64;
        let ms = |d: Duration| d.as_secs_f64() * 1000.0;
        let mib = |b: f64| b / f64::from(1u32 << 20);
        let mut rows = vec![
            (
                "frozen time, ms (2nd; peer: criu dump to tmpfs)",
                st(&self.ck2, "frozen_ms"),
                ms(self.peer2.dump),
                1.2,
            ),
            ("time until durable, ms (2nd)", st(&self.ck2, "durable_ms"), ms(self.peer2.durable), 0.4),
            (
                "bytes uploaded, MiB (2nd)",
                mib(st(&self.ck2, "bytes_uploaded")),
                mib(self.peer2.bytes as f64),
                0.25,
            ),
            (
                "2nd upload vs memory dirtied, MiB",
                mib(st(&self.ck2, "bytes_uploaded")),
                mib(self.dirtied as f64),
                1.2,
            ),
            (
                "2nd upload vs 1st upload, MiB",
                mib(st(&self.ck2, "bytes_uploaded")),
                mib(st(&self.ck1, "bytes_uploaded")),
                0.25,
            ),
            (
                "restore time, ms (2nd; peer: unpack + criu restore)",
                ms(self.stasis_restore),
                ms(self.peer_restore),
                1.0,
            ),
            (
                "stasisd peak RSS vs staging bound + 256 MiB, MiB",
                mib(self.peak_rss as f64),
                mib((self.staging_bound + RSS_SLACK) as f64),
                1.0,
            ),
        ];
        rows.push(("(1st) frozen time, ms", st(&self.ck1, "frozen_ms"), ms(self.peer1.dump), f64::NAN));
        rows.push((
            "(1st) time until durable, ms",
            st(&self.ck1, "durable_ms"),
            ms(self.peer1.durable),
            f64::NAN,
        ));
        rows.push((
            "(1st) bytes uploaded, MiB",
            mib(st(&self.ck1, "bytes_uploaded")),
            mib(self.peer1.bytes as f64),
            f64::NAN,
        ));
        let mut out = format!(
            "workload: {} MiB RSS, {:.0}% random, {:.0}% compressible, {:.0}% dirtied between checkpoints\n\n\
             | measure | stasis | peer / reference | ratio | target | |\n|---|---|---|---|---|---|\n",
            args.rss_mib,
            args.random * 100.0,
            args.compressible * 100.0,
            args.dirty * 100.0
        );
        for (name, ours, theirs, target) in rows {
            let ratio = ours / theirs;
            let (target, verdict) = if target.is_nan() {
                (String::new(), String::new())
            } else {
                (format!("≤ {target}"), if ratio <= target { "met".into() } else { "MISSED".into() })
            };
            out.push_str(&format!(
                "| {name} | {ours:.1} | {theirs:.1} | {ratio:.2} | {target} | {verdict} |\n"
            ));
        }
        out
    }
}
