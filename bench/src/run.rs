//! One benchmark run: stasisd and the workload; a full checkpoint each way, then rounds of
//! incremental checkpoints each way after the workload rewrote memory, then rounds of restores
//! each way of the last ones.

use std::path::{Path, PathBuf};
use std::time::{Duration, Instant};

use anyhow::{Context, bail};
use nix::sys::signal::{Signal, kill};
use nix::unistd::Pid;
use serde_json::Value;

use crate::Args;
use crate::daemon::{Daemon, Extra, kill_and_wait, log_line, settle, wait_until};
use crate::peer::{Peer, PeerCheckpoint, PeerRestore};

/// One incremental checkpoint each way, after the workload rewrote memory.
pub struct Round {
    /// `stasis checkpoint --json`.
    pub ck: Value,
    pub peer: PeerCheckpoint,
    /// Bytes the workload wrote since the previous checkpoint, counted in the 64 KiB windows
    /// it touched.
    pub dirtied: u64,
    pub stasis_first: bool,
}

/// One restore each way of the last round's checkpoints (stasis first in odd rounds).
pub struct RestoreRound {
    /// `stasis restore --json`, and its wall time.
    pub stasis: Value,
    pub wall: Duration,
    pub peer: PeerRestore,
    /// VmRSS of the restored workload right after each restore (a sanity check).
    pub rss: u64,
    pub peer_rss: u64,
}

/// Everything measured.
pub struct Results {
    /// The first (full) checkpoint each way, stasis first.
    pub ck1: Value,
    pub peer1: PeerCheckpoint,
    pub rounds: Vec<Round>,
    pub restores: Vec<RestoreRound>,
    /// stasisd's peak resident memory (VmHWM) over the first checkpoint, over the later ones,
    /// over the restores, and its staging bound.
    pub peak_rss_first: u64,
    pub peak_rss: u64,
    pub peak_rss_restore: u64,
    pub staging_bound: u64,
    /// How long this machine took, after the restores, to give a process as much fresh
    /// memory as the workload holds (4 KiB pages): a floor no restore goes below.
    pub first_touch: Duration,
}

pub fn checkpoint(d: &Daemon) -> anyhow::Result<Value> {
    settle();
    d.cli(&["checkpoint", "--workload", "bench", "--leave-running", "--json"])
        .with_context(|| format!("checkpoint failed; stasisd's log:\n{}", d.log_tail()))
}

/// Resident memory of a process, bytes.
pub fn vm_rss(pid: i32) -> u64 {
    stasis_tests::procfs::status_bytes(pid, "VmRSS").unwrap_or(0)
}

fn staging_bound(args: &Args) -> u64 {
    args.staging_mib.map(|m| m << 20).unwrap_or_else(|| {
        let mem = std::fs::read_to_string("/proc/meminfo").unwrap_or_default();
        let kib: u64 = mem
            .lines()
            .find_map(|l| l.strip_prefix("MemTotal:")?.split_whitespace().next()?.parse().ok())
            .unwrap_or(0);
        (kib << 10) / 4
    })
}

/// Starts the workload through stasisd and waits for its `ready`; returns its pid and log.
pub fn start_workload(d: &Daemon, args: &Args) -> anyhow::Result<(i32, PathBuf)> {
    let bin = std::fs::canonicalize("target/release/stasis-bench-workload")
        .context("no target/release/stasis-bench-workload: cargo build --release --workspace")?;
    let command = [
        bin.display().to_string(),
        format!("--rss-mib={}", args.rss_mib),
        format!("--random={}", args.random),
        format!("--compressible={}", args.compressible),
        format!("--zero={}", args.zero()),
        format!("--dirty={}", args.dirty),
        format!("--dirty-block-kib={}", args.dirty_block_kib),
        format!("--working-set={}", args.working_set),
    ];
    let churn = args.churn.then(|| "--churn".to_string());
    // In stasisd's pid namespace: the peer pipeline restores the same pids, and both ways are
    // measured on the process that keeps them (the namespace's init adds nothing to measure).
    let mut argv = vec!["run", "--host-pids", "--workload", "bench", "--json", "--"];
    argv.extend(command.iter().chain(&churn).map(String::as_str));
    let run = d.cli(&argv)?;
    let pid = run["pid"].as_i64().context("`stasis run --json` printed no pid")? as i32;
    d.set_workload(Some(pid));
    let log = PathBuf::from(run["log"].as_str().context("`stasis run --json` printed no log")?);
    let alive = || Path::new(&format!("/proc/{pid}")).exists();
    wait_until("the workload's `ready`", Duration::from_secs(600), || {
        log_line(&log, "ready").is_some() || !alive()
    })?;
    if log_line(&log, "ready").is_none() {
        bail!("the workload exited: {}", std::fs::read_to_string(&log).unwrap_or_default());
    }
    Ok((pid, log))
}

/// Sends `signal` to the workload and returns what follows `prefix` on the next line it
/// prints starting with `prefix`.
pub fn ask(pid: i32, log: &Path, signal: Signal, prefix: &str, timeout: Duration) -> anyhow::Result<String> {
    let lines = || -> Vec<String> {
        let text = std::fs::read_to_string(log).unwrap_or_default();
        text.lines().filter(|l| l.starts_with(prefix)).map(str::to_string).collect()
    };
    let before = lines().len();
    kill(Pid::from_raw(pid), signal).context("signalling the workload")?;
    wait_until(&format!("the workload's `{prefix}`"), timeout, || lines().len() > before)?;
    let line = lines().pop().context("no line")?;
    Ok(line[prefix.len()..].trim().to_string())
}

/// Has the workload rewrite its memory; returns the bytes it wrote, counted in the 64 KiB
/// windows it touched (a chunk is stored anew when any byte of its window changed).
pub fn dirty(pid: i32, log: &Path) -> anyhow::Result<u64> {
    let answer = ask(pid, log, Signal::SIGUSR1, "dirtied ", Duration::from_secs(120))?;
    // "<N> pages <W> windows"
    let windows: u64 = answer
        .split_whitespace()
        .nth(2)
        .and_then(|n| n.parse().ok())
        .with_context(|| format!("unexpected line from the workload: dirtied {answer}"))?;
    Ok(windows << 16)
}

/// The time to write one byte into each page of `bytes` of fresh memory (then freed), in
/// 4 KiB pages as a restore's `UFFDIO_COPY` gives them (a heap this large is not eligible for
/// huge pages unless transparent huge pages are `always`): what a restore of that much
/// memory costs at least on this machine.
fn first_touch(bytes: u64) -> Duration {
    let started = Instant::now();
    let mut fresh = vec![0u8; bytes as usize];
    for page in fresh.chunks_mut(4096) {
        page[0] = 1;
    }
    std::hint::black_box(&fresh);
    started.elapsed()
}

/// Restores the stasis checkpoint `id`, then kills the restored tree.
fn stasis_restore(d: &Daemon, id: &str) -> anyhow::Result<(Value, Duration, u64)> {
    settle();
    let started = Instant::now();
    let restore = d
        .cli(&["restore", id, "--json"])
        .with_context(|| format!("restore failed; stasisd's log:\n{}", d.log_tail()))?;
    let wall = started.elapsed();
    let pid = restore["pid"].as_i64().context("`stasis restore --json` printed no pid")? as i32;
    d.set_workload(Some(pid));
    let rss = vm_rss(pid);
    kill_and_wait(pid)?;
    Ok((restore, wall, rss))
}

/// Restores the peer's tarball (the tree gets its old pid back), then kills it.
fn peer_restore(d: &Daemon, peer: &Peer, tarball: &Path, pid: i32) -> anyhow::Result<(PeerRestore, u64)> {
    let restored = peer.restore(tarball)?;
    d.set_workload(Some(pid));
    let rss = vm_rss(pid);
    kill_and_wait(pid)?;
    Ok((restored, rss))
}

pub fn run(args: &Args) -> anyhow::Result<Results> {
    let criu = std::fs::canonicalize(".stasis/criu/bin/criu")
        .context("no .stasis/criu/bin/criu: run scripts/setup-criu.sh, and this from the repository root")?;
    let id = std::process::id();
    let work = args.store_dir.join(format!("run-{id}"));
    let scratch = args.peer_scratch.join(format!("stasis-bench-{id}"));
    let d = Daemon::start(
        &criu,
        work,
        scratch,
        args.keep,
        &Extra { args: args.daemon_flags(), ..Default::default() },
    )?;
    let (pid, log) = start_workload(&d, args)?;
    let peer = Peer::beside(&d, criu);

    // The first checkpoint: stasis first, the peer dumps the same process right after.
    let ck1 = checkpoint(&d)?;
    let peer1 = peer.checkpoint(pid, "ck1")?;
    let peak_rss_first = d.peak_rss()?;
    d.reset_peak_rss()?;
    let mut rounds = Vec::new();
    for i in 0..args.rounds as usize {
        let dirtied = dirty(pid, &log)?;
        let stasis_first = i % 2 == 0;
        let peer_before = if stasis_first { None } else { Some(peer.checkpoint(pid, "ck2")?) };
        let ck = checkpoint(&d)?;
        let peer = match peer_before {
            Some(p) => p,
            None => peer.checkpoint(pid, "ck2")?,
        };
        rounds.push(Round { ck, peer, dirtied, stasis_first });
    }
    let last = rounds.last().context("no rounds")?;
    let ck_id = last.ck["id"].as_str().context("`stasis checkpoint --json` printed no id")?.to_string();
    let tarball = last.peer.tarball.clone();
    let peak_rss = d.peak_rss()?;
    d.reset_peak_rss()?;

    kill_and_wait(pid)?;
    let mut restores = Vec::new();
    for i in 0..args.rounds as usize {
        let stasis_first = i % 2 == 0;
        let peer_before = if stasis_first { None } else { Some(peer_restore(&d, &peer, &tarball, pid)?) };
        let (stasis, wall, rss) = stasis_restore(&d, &ck_id)?;
        let (peer, peer_rss) = match peer_before {
            Some(p) => p,
            None => peer_restore(&d, &peer, &tarball, pid)?,
        };
        restores.push(RestoreRound { stasis, wall, peer, rss, peer_rss });
    }
    d.set_workload(None);

    let (peak_rss_restore, staging_bound) = (d.peak_rss()?, staging_bound(args));
    // Last, so that it pushes nothing the restores read out of the page cache.
    settle();
    let first_touch = first_touch(args.rss_mib << 20);
    Ok(Results {
        ck1,
        peer1,
        rounds,
        restores,
        peak_rss_first,
        peak_rss,
        peak_rss_restore,
        staging_bound,
        first_touch,
    })
}
