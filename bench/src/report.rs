//! The Markdown table of a run: stasis against the peer pipeline, with ratios and targets.

use std::fmt::Write as _;
use std::time::Duration;

use serde_json::Value;

use crate::Args;
use crate::peer::PeerCheckpoint;
use crate::run::{RestoreRound, Results};

/// Allowed over the staging bound: the daemon itself, pack buffers, uploads in flight.
const RSS_SLACK: u64 = 256 << 20;

struct Row {
    name: &'static str,
    /// One value per round (one for single measurements).
    ours: Vec<f64>,
    theirs: Vec<f64>,
    /// Highest ratio ours / theirs that meets issue 3's target; `None` for figures shown only.
    target: Option<f64>,
}

fn row(name: &'static str, ours: Vec<f64>, theirs: Vec<f64>, target: Option<f64>) -> Row {
    Row { name, ours, theirs, target }
}

/// The measures a printed table says missed their target: rows whose last cell is `MISS`
/// (the main and lazy tables) or `missed` (the Kubernetes one).
pub fn misses(table: &str) -> Vec<&str> {
    table
        .lines()
        .filter(|l| {
            let cells: Vec<&str> = l.trim_end().trim_end_matches('|').rsplit('|').collect();
            cells.first().is_some_and(|c| matches!(c.trim(), "MISS" | "missed"))
        })
        .map(|l| l.trim_start_matches('|').split('|').next().unwrap_or_default().trim())
        .collect()
}

/// Ours against theirs, round by round; a figure measured once (a bound, the machine's first
/// touch) is what every round is compared with.
fn ratios(ours: &[f64], theirs: &[f64]) -> Vec<f64> {
    match (ours, theirs) {
        (_, [one]) => ours.iter().map(|a| a / one).collect(),
        ([one], _) => theirs.iter().map(|b| one / b).collect(),
        _ => ours.iter().zip(theirs).map(|(a, b)| a / b).collect(),
    }
}

pub fn median(values: &[f64]) -> f64 {
    let mut v = values.to_vec();
    v.sort_by(f64::total_cmp);
    match v.len() {
        0 => f64::NAN,
        n if n % 2 == 1 => v[n / 2],
        n => (v[n / 2 - 1] + v[n / 2]) / 2.0,
    }
}

fn ms(d: Duration) -> f64 {
    d.as_secs_f64() * 1000.0
}

fn mib(bytes: f64) -> f64 {
    bytes / f64::from(1u32 << 20)
}

/// A number in the `stats` object of the CLI's JSON.
fn stat(v: &Value, key: &str) -> f64 {
    v["stats"][key].as_u64().unwrap_or(0) as f64
}

impl Results {
    fn rows(&self) -> Vec<Row> {
        let (ck1, p1, rounds, restores) = (&self.ck1, &self.peer1, &self.rounds, &self.restores);
        let ck = |f: &dyn Fn(&Value) -> f64| rounds.iter().map(|r| f(&r.ck)).collect::<Vec<_>>();
        let peer = |f: &dyn Fn(&PeerCheckpoint) -> f64| rounds.iter().map(|r| f(&r.peer)).collect::<Vec<_>>();
        let rs = |f: &dyn Fn(&RestoreRound) -> f64| restores.iter().map(f).collect::<Vec<_>>();
        let up = || ck(&|c| mib(stat(c, "bytes_uploaded")));
        let ck1_up = mib(stat(ck1, "bytes_uploaded"));
        let bound = vec![mib((self.staging_bound + RSS_SLACK) as f64)];
        vec![
            row(
                "frozen time, ms: 2nd vs `criu dump` to tmpfs",
                ck(&|c| stat(c, "frozen_ms")),
                peer(&|p| ms(p.dump)),
                Some(1.0),
            ),
            row(
                "time until durable, ms: 2nd vs dump + `tar \\| zstd` into the store",
                ck(&|c| stat(c, "durable_ms")),
                peer(&|p| ms(p.written)),
                Some(0.4),
            ),
            row(
                "bytes uploaded, MiB: 2nd vs the peer's tarball",
                up(),
                peer(&|p| mib(p.bytes as f64)),
                Some(0.25),
            ),
            row(
                "bytes uploaded, MiB: 2nd vs memory written (64 KiB windows)",
                up(),
                rounds.iter().map(|r| mib(r.dirtied as f64)).collect(),
                Some(1.1),
            ),
            row("bytes uploaded, MiB: 2nd vs 1st", up(), vec![ck1_up; rounds.len()], Some(0.25)),
            row(
                "restore time, ms: `stasis restore` vs unpack to tmpfs + `criu restore`",
                rs(&|r| ms(r.wall)),
                rs(&|r| ms(r.peer.total)),
                Some(0.3),
            ),
            row(
                "stasisd peak RSS (1st checkpoint) vs staging bound + 256 MiB, MiB",
                vec![mib(self.peak_rss_first as f64)],
                bound.clone(),
                Some(1.0),
            ),
            row(
                "stasisd peak RSS (2nd checkpoints) vs 2 x memory written + 256 MiB, MiB",
                vec![mib(self.peak_rss as f64)],
                vec![mib((2 * rounds.iter().map(|r| r.dirtied).max().unwrap_or(0) + RSS_SLACK) as f64)],
                Some(1.0),
            ),
            row(
                "stasisd peak RSS (restores) vs staging bound + 256 MiB, MiB",
                vec![mib(self.peak_rss_restore as f64)],
                bound,
                Some(1.0),
            ),
            row(
                "dump phase, ms: 2nd, request to CRIU's exit vs `criu dump`",
                ck(&|c| stat(c, "dump_ms")),
                peer(&|p| ms(p.dump)),
                Some(1.2),
            ),
            row(
                "(2nd) durable, ms: vs the peer with fsync of its tarball",
                ck(&|c| stat(c, "durable_ms")),
                peer(&|p| ms(p.fsynced)),
                None,
            ),
            row(
                "(restore) fetch, ms: vs `zstd -d \\| tar -x`",
                rs(&|r| stat(&r.stasis, "fetch_ms")),
                rs(&|r| ms(r.peer.unpack)),
                None,
            ),
            row(
                "(restore) CRIU, ms: stasisd's `criu restore` vs the peer's",
                rs(&|r| stat(&r.stasis, "criu_ms")),
                rs(&|r| ms(r.peer.total - r.peer.unpack)),
                None,
            ),
            row(
                "(restore) `stasis restore` vs this machine's first touch of as much fresh memory, ms",
                rs(&|r| ms(r.wall)),
                vec![ms(self.first_touch)],
                None,
            ),
            row(
                "(restore) restored process's VmRSS, MiB",
                rs(&|r| mib(r.rss as f64)),
                rs(&|r| mib(r.peer_rss as f64)),
                None,
            ),
            row("(1st) frozen time, ms", vec![stat(ck1, "frozen_ms")], vec![ms(p1.dump)], None),
            row("(1st) time until durable, ms", vec![stat(ck1, "durable_ms")], vec![ms(p1.written)], None),
            row("(1st) bytes uploaded, MiB", vec![ck1_up], vec![mib(p1.bytes as f64)], None),
        ]
    }

    pub fn table(&self, args: &Args) -> String {
        let dirtied: Vec<f64> = self.rounds.iter().map(|r| mib(r.dirtied as f64)).collect();
        let mut out = String::new();
        let _ = writeln!(
            out,
            "workload: {} MiB, {:.0}% random, {:.0}% compressible, {:.0}% zero; {:.0}% rewritten before \
             each incremental checkpoint, in {} KiB blocks{} ({:.1} MiB written, counted in 64 KiB \
             windows); staging bound {:.0} MiB; {} round(s) (stasis and peer order alternating), \
             medians shown; {}\n",
            args.rss_mib,
            args.random * 100.0,
            args.compressible * 100.0,
            args.zero() * 100.0,
            args.dirty * 100.0,
            args.dirty_block_kib,
            if args.churn { ", plus heap churn and scattered 4 KiB writes" } else { "" },
            median(&dirtied),
            mib(self.staging_bound as f64),
            self.rounds.len(),
            if args.no_settle { "measured back to back" } else { "machine settled before each step" },
        );
        out.push_str("| measure | stasis | peer / reference | ratio | ratio per round | target | |\n");
        out.push_str("|---|---|---|---|---|---|---|\n");
        for r in self.rows() {
            let ratios = ratios(&r.ours, &r.theirs);
            let ratio = median(&ratios);
            let per_round = if ratios.len() > 1 {
                ratios.iter().map(|x| format!("{x:.2}")).collect::<Vec<_>>().join(" / ")
            } else {
                String::new()
            };
            let (target, verdict) = match r.target {
                Some(t) => (format!("≤ {t}"), if ratio <= t { "PASS" } else { "MISS" }),
                None => (String::new(), ""),
            };
            let (ours, theirs) = (median(&r.ours), median(&r.theirs));
            let _ = writeln!(
                out,
                "| {} | {ours:.1} | {theirs:.1} | {ratio:.3} | {per_round} | {target} | {verdict} |",
                r.name
            );
        }
        out.push('\n');
        let mut cks = vec![("1st (stasis first)".to_string(), &self.ck1)];
        for (i, r) in self.rounds.iter().enumerate() {
            let order = if r.stasis_first { "stasis first" } else { "peer first" };
            cks.push((format!("incremental {} ({order})", i + 1), &r.ck));
        }
        for (name, ck) in cks {
            let _ = writeln!(
                out,
                "- {name}: {}, {:.1} MiB of pages, {} chunks ({} new, {} zero), {:.1} MiB uploaded; \
                 frozen {} ms, durable {} ms",
                ck["id"].as_str().unwrap_or("?"),
                mib(stat(ck, "bytes_total")),
                stat(ck, "chunks_total"),
                stat(ck, "chunks_new"),
                stat(ck, "chunks_zero"),
                mib(stat(ck, "bytes_uploaded")),
                stat(ck, "frozen_ms"),
                stat(ck, "durable_ms"),
            );
        }
        out
    }
}

#[cfg(test)]
mod tests {
    use super::{median, misses, ratios};

    #[test]
    fn every_round_is_compared_with_a_figure_measured_once() {
        let by_round = ratios(&[3.0, 1.0, 2.0], &[2.0]);
        assert_eq!(by_round, [1.5, 0.5, 1.0]);
        assert_eq!(median(&by_round), 1.0, "the median round, not the first");
        assert_eq!(ratios(&[4.0], &[2.0, 8.0]), [2.0, 0.5]);
        assert_eq!(ratios(&[1.0, 6.0], &[2.0, 3.0]), [0.5, 2.0], "round by round");
    }

    #[test]
    fn the_rows_that_missed_are_named() {
        let table = "| measure | a | b | ratio | | target | |\n|---|---|---|---|---|---|---|\n\
                     | frozen | 1 | 2 | 0.5 | | ≤ 1 | PASS |\n| durable | 3 | 4 | 0.75 | | ≤ 0.4 | MISS |\n\
                     | shown | 1 | 1 | 1 | | | |\n| eviction | 1 | 2 | 0.5 | ≤ 0.2 | missed |\n";
        assert_eq!(misses(table), ["durable", "eviction"]);
    }
}
