//! The lazy-restore benchmark: the same checkpoint restored eagerly and lazily by stasis, and
//! the same memory by the peer (`peer.rs`), in alternating order, on a local store or the S3
//! test server; the workload's checksum is checked after every restore (once resident, for
//! the lazy ones). The peer's restore is timed by the benchmark's own clock (the shell
//! pipeline's start-up included), stasis's by its own stats.
//!
//! Targets: the working set read right after a `--no-wait` lazy restore (the workload at once
//! reads the blocks it rewrote before the checkpoint, and says how long that took) <= 0.3x the
//! eager restore's time (issue 28). Issue 10's `first_run_ms` <= 0.05x and `resident_ms` <=
//! 0.5x are taken against the peer's restore (unpack, then `criu restore`) of the same memory:
//! issue 10 set them against an eager restore that took 0.97x the peer's, and the eager
//! restore has since become the same machinery as the lazy one, waited for, so that against it
//! `resident_ms` is about 1.0 by construction (the ratios to it are shown beside).
//! The eager restore is stasisd's `--eager-restore` mode: `served` (stasisd puts memory in
//! place, as it does for the lazy one) or `files` (CRIU reads image files).

use std::path::Path;
use std::time::Duration;

use anyhow::{Context, bail, ensure};
use nix::sys::signal::Signal;
use serde_json::Value;
use stasis_tests::s3::S3Server;

use crate::Args;
use crate::daemon::{Daemon, Extra, kill_and_wait, settle, wait_until};
use crate::peer::Peer;
use crate::report::median;
use crate::run::{ask, checkpoint, dirty, start_workload};

/// How long the workload may take to read its memory (4 GiB, faulting it in page by page).
const READ_WAIT: Duration = Duration::from_secs(300);

/// One peer, one eager and one lazy restore of the same memory.
pub struct Round {
    pub eager_ms: u64,
    /// The peer's restore of the same memory: unpack, then `criu restore`.
    pub peer_ms: u64,
    pub first_run_ms: u64,
    pub resident_ms: u64,
    pub lazy_bytes_fetched: u64,
    /// Time the workload took to read its working set right after a `--no-wait` restore.
    pub touch_ms: u64,
    /// Bytes stasisd read from the disk over that restore and read: a local store's packs
    /// not in the page cache.
    pub touch_disk_bytes: u64,
    pub eager_first: bool,
}

pub struct LazyResults {
    pub store: &'static str,
    pub prefetch: String,
    pub eager_restore: String,
    pub bytes_total: u64,
    /// Whether the store's files were dropped from the page cache before each restore.
    pub cold: bool,
    pub rounds: Vec<Round>,
}

/// A lazy restore that returns once the tree runs; the workload then reads its working set
/// at once. Returns how long that took it, ms.
fn touch_after_restore(d: &Daemon, cold: bool, id: &str, pid: i32, log: &Path) -> anyhow::Result<(u64, u64)> {
    settle_store(d, cold)?;
    let disk_before = d.disk_read_bytes()?;
    d.cli(&["restore", id, "--lazy", "--no-wait", "--json"])
        .with_context(|| format!("restore failed; stasisd's log:\n{}", d.log_tail()))?;
    d.set_workload(Some(pid));
    let ms = ask(pid, log, Signal::SIGHUP, "touched ", READ_WAIT)?
        .parse()
        .context("`touched` without a number")?;
    let disk = d.disk_read_bytes()? - disk_before;
    kill_and_wait(pid)?;
    Ok((ms, disk))
}

/// Lets the machine settle before a restore; with `cold`, drops the store's files from the
/// page cache too.
fn settle_store(d: &Daemon, cold: bool) -> anyhow::Result<()> {
    settle();
    if cold {
        d.uncache_store()?;
    }
    Ok(())
}

/// Restores `id` (lazily with `--lazy`), checks the checksum, kills the tree.
fn restore(
    d: &Daemon,
    cold: bool,
    id: &str,
    lazy: bool,
    pid: i32,
    log: &Path,
    sum: &str,
) -> anyhow::Result<Value> {
    settle_store(d, cold)?;
    let mut argv = vec!["restore", id, "--json"];
    if lazy {
        argv.push("--lazy");
    }
    let r = d.cli(&argv).with_context(|| format!("restore failed; stasisd's log:\n{}", d.log_tail()))?;
    checked_and_killed(d, pid, log, sum, if lazy { "a lazy" } else { "an eager" })?;
    Ok(r)
}

/// The tree restored as `pid` (by `what` restore): its memory's checksum must be `sum`; then
/// it is killed.
fn checked_and_killed(d: &Daemon, pid: i32, log: &Path, sum: &str, what: &str) -> anyhow::Result<()> {
    d.set_workload(Some(pid));
    let restored = ask(pid, log, Signal::SIGUSR2, "checksum ", READ_WAIT)?;
    ensure!(restored == sum, "memory differs after {what} restore: {restored} vs {sum}");
    kill_and_wait(pid)
}

/// Restores the peer's tarball (the tree gets its old pid back), checks the checksum, kills
/// the tree; returns how long the restore took, ms.
fn peer_restore(
    d: &Daemon,
    cold: bool,
    peer: &Peer,
    tarball: &Path,
    pid: i32,
    log: &Path,
    sum: &str,
) -> anyhow::Result<u64> {
    if cold {
        d.uncache_store()?;
    }
    // The peer lets the machine settle itself, and names its tarball's pid only once CRIU gave
    // it back (a pid it failed to take back may be another process's).
    let restored = peer.restore(tarball)?;
    checked_and_killed(d, pid, log, sum, "the peer's")?;
    Ok(restored.total.as_millis() as u64)
}

pub fn run(args: &Args, s3: bool, prefetch: &str, eager_restore: &str) -> anyhow::Result<LazyResults> {
    ensure!(
        !(s3 && args.cold_store),
        "--cold-store drops a local store's files from the page cache: not with --s3"
    );
    let criu = std::fs::canonicalize(".stasis/criu/bin/criu")
        .context("no .stasis/criu/bin/criu: run scripts/setup-criu.sh, and this from the repository root")?;
    let id = std::process::id();
    let work = args.store_dir.join(format!("lazy-{id}"));
    let scratch = args.peer_scratch.join(format!("stasis-bench-{id}"));
    let server = if s3 {
        Some(S3Server::start().context("no moto_server: scripts/test.sh installs it into .stasis/venv")?)
    } else {
        None
    };
    let lazy_args =
        ["--lazy-prefetch", prefetch, "--eager-restore", eager_restore].map(str::to_string).to_vec();
    let mut extra = Extra { args: [lazy_args, args.daemon_flags()].concat(), ..Default::default() };
    if let Some(server) = &server {
        let options = server.daemon_options("bench", &[]);
        (extra.store, extra.env) = (options.store, options.env);
    }
    let d = Daemon::start(&criu, work, scratch, args.keep, &extra)?;
    let (pid, log) = start_workload(&d, args)?;
    let peer = Peer::beside(&d, criu);

    // A full checkpoint, memory written since, then the evicting one that is restored.
    checkpoint(&d)?;
    dirty(pid, &log)?;
    let sum = ask(pid, &log, Signal::SIGUSR2, "checksum ", READ_WAIT)?;
    let tarball = peer.checkpoint(pid, "lazy")?.tarball;
    settle();
    let ck = d.cli(&["checkpoint", "--workload", "bench", "--json"])?;
    let ck_id = ck["id"].as_str().context("`stasis checkpoint --json` printed no id")?.to_string();
    let bytes_total = ck["stats"]["bytes_total"].as_u64().unwrap_or_default();
    wait_until("the evicted workload to be gone", Duration::from_secs(60), || {
        !Path::new(&format!("/proc/{pid}")).exists()
    })?;

    let mut rounds = Vec::new();
    let cold = args.cold_store;
    for i in 0..args.rounds as usize {
        let eager_first = i % 2 == 0;
        let (mut eager, mut peer_ms) = (None, None);
        if eager_first {
            peer_ms = Some(peer_restore(&d, cold, &peer, &tarball, pid, &log, &sum)?);
            eager = Some(restore(&d, cold, &ck_id, false, pid, &log, &sum)?);
        }
        let lazy = restore(&d, cold, &ck_id, true, pid, &log, &sum)?;
        let eager = match eager {
            Some(e) => e,
            None => restore(&d, cold, &ck_id, false, pid, &log, &sum)?,
        };
        let peer_ms = match peer_ms {
            Some(ms) => ms,
            None => peer_restore(&d, cold, &peer, &tarball, pid, &log, &sum)?,
        };
        let (touch_ms, touch_disk_bytes) = touch_after_restore(&d, cold, &ck_id, pid, &log)?;
        let ms = |v: &Value, key: &str| v["stats"][key].as_u64().with_context(|| format!("no {key} in {v}"));
        if lazy["stats"]["lazy"] != true {
            bail!("the lazy restore did not report itself lazy: {lazy}");
        }
        rounds.push(Round {
            eager_ms: ms(&eager, "restore_ms")?,
            peer_ms,
            first_run_ms: ms(&lazy, "first_run_ms")?,
            resident_ms: ms(&lazy, "resident_ms")?,
            lazy_bytes_fetched: ms(&lazy, "bytes_fetched")?,
            touch_ms,
            touch_disk_bytes,
            eager_first,
        });
    }
    d.set_workload(None);
    let store = if s3 { "S3 test server (moto)" } else { "local (file://)" };
    Ok(LazyResults {
        store,
        prefetch: prefetch.to_string(),
        eager_restore: eager_restore.to_string(),
        bytes_total,
        cold,
        rounds,
    })
}

impl LazyResults {
    /// The results as a Markdown table with ratios and targets.
    pub fn table(&self, args: &Args) -> String {
        let col = |f: fn(&Round) -> u64| self.rounds.iter().map(|r| f(r) as f64).collect::<Vec<f64>>();
        let (eager, peer) = (col(|r| r.eager_ms), col(|r| r.peer_ms));
        let (first, touch, resident) = (col(|r| r.first_run_ms), col(|r| r.touch_ms), col(|r| r.resident_ms));
        // One row: the lazy figure against a reference of the same rounds, with a target or
        // as context.
        let row = |name: &str, v: &[f64], against: (&str, &[f64]), target: Option<f64>| {
            let (reference, theirs) = against;
            let ratio = median(v) / median(theirs);
            let per_round = v.iter().zip(theirs).map(|(n, e)| format!("{:.2}", n / e)).collect::<Vec<_>>();
            let (target, verdict) = match target {
                Some(t) => (format!("≤ {t}"), if ratio <= t { "PASS" } else { "MISS" }),
                None => ("—".into(), ""),
            };
            format!(
                "| {name} | {:.0} | {reference} {:.0} | {ratio:.3} | {} | {target} | {verdict} |\n",
                median(v),
                median(theirs),
                per_round.join(" / ")
            )
        };
        let (eager, peer) = (("eager restore", eager.as_slice()), ("peer's restore", peer.as_slice()));
        let mut out = format!(
            "lazy restore: workload {} MiB ({} MiB of pages in the checkpoint), store: {}{}, prefetch {}, \
             eager restore `{}`; {} round(s), in alternating order (peer, eager, lazy in odd rounds; \
             lazy, eager, peer in even ones; then the working set's restore), medians shown; checksums identical \
             after every restore; working set: {:.0} MiB {}\n\n",
            args.rss_mib,
            self.bytes_total >> 20,
            self.store,
            if self.cold { " (its files dropped from the page cache before each restore)" } else { "" },
            self.prefetch,
            self.eager_restore,
            self.rounds.len(),
            args.rss_mib as f64 * args.dirty,
            match args.working_set.as_str() {
                "first" =>
                    "from the start of its memory, read in order (mostly not rewritten since the checkpoint before)",
                "strided" =>
                    "in blocks halfway between the rewritten ones (mostly not rewritten since the checkpoint before)",
                "random" => "as single pages anywhere in its memory",
                _ => "rewritten before the checkpoint",
            },
        );
        out.push_str("| measure | lazy, ms | against, ms | ratio | ratio per round | target | |\n");
        out.push_str("|---|---|---|---|---|---|---|\n");
        out.push_str(&row("first_run_ms: request until the tree runs", &first, peer, Some(0.05)));
        out.push_str(&row(
            "working set read by the workload right after a --no-wait restore",
            &touch,
            eager,
            Some(0.3),
        ));
        out.push_str(&row("resident_ms: request until every page is in", &resident, peer, Some(0.5)));
        out.push_str(&row("first_run_ms, against the eager restore", &first, eager, None));
        out.push_str(&row("resident_ms, against the eager restore", &resident, eager, None));
        for (i, r) in self.rounds.iter().enumerate() {
            out.push_str(&format!(
                "\n- round {}: peer {} ms, eager {} ms, lazy first run {} ms, resident {} ms, {} MiB fetched, working set \
                 read {} ms after a --no-wait restore ({} MiB of it read from the disk) ({})",
                i + 1,
                r.peer_ms,
                r.eager_ms,
                r.first_run_ms,
                r.resident_ms,
                r.lazy_bytes_fetched >> 20,
                r.touch_ms,
                r.touch_disk_bytes >> 20,
                if r.eager_first { "peer, eager, lazy" } else { "lazy, eager, peer" }
            ));
        }
        out
    }
}

#[cfg(test)]
mod tests {
    use clap::Parser;

    use super::{LazyResults, Round};
    use crate::report::misses;

    fn results(resident_ms: u64) -> LazyResults {
        let round = |eager_first| Round {
            eager_ms: 1000,
            peer_ms: 4000,
            first_run_ms: 150,
            resident_ms,
            lazy_bytes_fetched: 0,
            touch_ms: 250,
            touch_disk_bytes: 0,
            eager_first,
        };
        LazyResults {
            store: "local (file://)",
            prefetch: "fresh-first".into(),
            eager_restore: "served".into(),
            bytes_total: 0,
            cold: false,
            rounds: vec![round(true), round(false)],
        }
    }

    #[test]
    fn issue_10s_targets_are_judged_against_the_peer_and_the_eager_ratios_are_context() {
        let args = crate::Cli::parse_from(["stasis-bench"]).args;
        let table = results(1100).table(&args);
        assert!(table.contains("| 1100 | peer's restore 4000 | 0.275 |"), "{table}");
        assert!(table.contains("| 250 | eager restore 1000 | 0.250 |"), "{table}");
        let context = "| resident_ms, against the eager restore | 1100 | eager restore 1000 | 1.100 |";
        assert!(table.contains(context), "{table}");
        assert!(misses(&table).is_empty(), "context rows are not judged: {table}");

        let table = results(2100).table(&args);
        assert_eq!(misses(&table), ["resident_ms: request until every page is in"], "{table}");
    }
}
