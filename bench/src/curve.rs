//! `stasis-bench curve`: the cost curve (issue 28, item 4). At each size, the main benchmark
//! (`run.rs`: checkpoints and eager restores each way) and the lazy one (`lazy.rs`: first run
//! and working set), on the same settings, but for the lazy one's store, read cold (see below);
//! then a table of every measure at every size with its slope per GiB beside the peer's, and
//! an SVG of the times against GiB (stasis solid, the peer dashed, one colour per measure). A
//! stasis measure that grows faster than linearly fails the run. The lazy benchmark runs with
//! `--cold-store` here: the store's packs stay cached beside a small workload and not beside a
//! large one, so that read warm the working set would be memory at the small sizes and the
//! disk at the large ones.

use std::fmt::Write as _;
use std::path::Path;

use anyhow::Context;
use plotters::prelude::*;

use crate::Args;
use crate::lazy::{self, LazyResults};
use crate::report::median;
use crate::run::{self, Results};

/// How much steeper the last stretch of a curve may be than its first before it counts as
/// growing faster than linearly (this machine is noisy: one run per size).
const STEEPER: f64 = 1.5;
/// Below this growth from the smallest size to the largest, in the measure's unit, a curve is
/// flat: fixed costs and noise, not a slope to judge.
const FLAT: f64 = 500.0;

/// Both benchmarks at one size.
pub struct Point {
    pub mib: u64,
    pub main: Results,
    pub lazy: LazyResults,
}

/// One measure across the sizes: stasis's values, and the peer's where it has one.
struct Measure {
    name: &'static str,
    unit: &'static str,
    ours: Vec<f64>,
    theirs: Option<Vec<f64>>,
    /// Whether growing faster than linearly fails the run (else it is context: what the
    /// machine or the store's medium did at each size).
    judged: bool,
}

/// Runs both benchmarks at each size in `sizes_mib`, smallest first.
pub fn run(args: &Args, sizes_mib: &[u64]) -> anyhow::Result<Vec<Point>> {
    let mut points = Vec::new();
    for &mib in sizes_mib {
        let args = Args { rss_mib: mib, ..args.clone() };
        eprintln!("cost curve: {mib} MiB, checkpoints and eager restores");
        let main = run::run(&args).with_context(|| format!("the main benchmark at {mib} MiB"))?;
        eprintln!("cost curve: {mib} MiB, lazy restores");
        // The store read cold at every size: cached while it fits beside the workload, it
        // would be read from memory at the small sizes and from the disk at the large ones.
        let lazy = lazy::run(&Args { cold_store: true, ..args.clone() }, false, "fresh-first", "served")
            .with_context(|| format!("the lazy benchmark at {mib} MiB"))?;
        points.push(Point { mib, main, lazy });
    }
    Ok(points)
}

fn ms(d: std::time::Duration) -> f64 {
    d.as_secs_f64() * 1000.0
}

/// A number in the `stats` object of the CLI's JSON.
fn stat(v: &serde_json::Value, key: &str) -> f64 {
    v["stats"][key].as_u64().unwrap_or(0) as f64
}

fn measures(points: &[Point]) -> Vec<Measure> {
    let each = |f: &dyn Fn(&Point) -> f64| points.iter().map(f).collect::<Vec<_>>();
    let rounds =
        |p: &Point, f: &dyn Fn(&run::Round) -> f64| median(&p.main.rounds.iter().map(f).collect::<Vec<_>>());
    let restores = |p: &Point, f: &dyn Fn(&run::RestoreRound) -> f64| {
        median(&p.main.restores.iter().map(f).collect::<Vec<_>>())
    };
    let lazy =
        |p: &Point, f: &dyn Fn(&lazy::Round) -> f64| median(&p.lazy.rounds.iter().map(f).collect::<Vec<_>>());
    let time = |name, ours: Vec<f64>, theirs: Option<Vec<f64>>| Measure {
        name,
        unit: "ms",
        ours,
        theirs,
        judged: true,
    };
    vec![
        time(
            "full checkpoint, durable (peer: dump + tar | zstd)",
            each(&|p| stat(&p.main.ck1, "durable_ms")),
            Some(each(&|p| ms(p.main.peer1.written))),
        ),
        time(
            "frozen, 10% rewritten (peer: criu dump)",
            each(&|p| rounds(p, &|r| stat(&r.ck, "frozen_ms"))),
            Some(each(&|p| rounds(p, &|r| ms(r.peer.dump)))),
        ),
        time(
            "dump phase, 10% rewritten (peer: criu dump)",
            each(&|p| rounds(p, &|r| stat(&r.ck, "dump_ms"))),
            Some(each(&|p| rounds(p, &|r| ms(r.peer.dump)))),
        ),
        time(
            "durable, 10% rewritten (peer: dump + tar | zstd)",
            each(&|p| rounds(p, &|r| stat(&r.ck, "durable_ms"))),
            Some(each(&|p| rounds(p, &|r| ms(r.peer.written)))),
        ),
        time(
            "eager restore (peer: unpack + criu restore)",
            each(&|p| restores(p, &|r| ms(r.wall))),
            Some(each(&|p| restores(p, &|r| ms(r.peer.total)))),
        ),
        time("lazy restore, first run", each(&|p| lazy(p, &|r| r.first_run_ms as f64)), None),
        time("lazy restore, working set read", each(&|p| lazy(p, &|r| r.touch_ms as f64)), None),
        Measure {
            name: "stasisd peak RSS",
            unit: "MiB",
            ours: each(&|p| {
                let m = &p.main;
                m.peak_rss_first.max(m.peak_rss).max(m.peak_rss_restore) as f64 / f64::from(1u32 << 20)
            }),
            theirs: None,
            judged: true,
        },
        Measure {
            name: "context: the working set read's restore, store bytes stasisd read from the disk",
            unit: "MiB",
            ours: each(&|p| lazy(p, &|r| (r.touch_disk_bytes >> 20) as f64)),
            theirs: None,
            judged: false,
        },
        Measure {
            name: "context: this machine's first touch of as much fresh memory",
            unit: "ms",
            ours: each(&|p| ms(p.main.first_touch)),
            theirs: None,
            judged: false,
        },
    ]
}

/// The least-squares slope of `ys` against `xs`.
fn slope(xs: &[f64], ys: &[f64]) -> f64 {
    let n = xs.len() as f64;
    let (mx, my) = (xs.iter().sum::<f64>() / n, ys.iter().sum::<f64>() / n);
    let num: f64 = xs.iter().zip(ys).map(|(x, y)| (x - mx) * (y - my)).sum();
    let den: f64 = xs.iter().map(|x| (x - mx) * (x - mx)).sum();
    if den > 0.0 { num / den } else { f64::NAN }
}

/// Whether `ys` (against `xs`, ascending) grows faster than linearly: its last stretch over
/// [`STEEPER`] times as steep as its first, and more than [`FLAT`] of growth overall.
fn superlinear(xs: &[f64], ys: &[f64]) -> bool {
    let n = xs.len();
    if n < 3 || ys[n - 1] - ys[0] <= FLAT {
        return false;
    }
    let first = (ys[1] - ys[0]) / (xs[1] - xs[0]);
    let last = (ys[n - 1] - ys[n - 2]) / (xs[n - 1] - xs[n - 2]);
    last > STEEPER * first.max(0.0) && last > 0.0
}

fn gib(points: &[Point]) -> Vec<f64> {
    points.iter().map(|p| p.mib as f64 / 1024.0).collect()
}

/// The Markdown table of the curve; with it, the stasis measures that grow faster than
/// linearly.
pub fn table(points: &[Point]) -> (String, Vec<&'static str>) {
    let xs = gib(points);
    let sizes: Vec<String> = xs.iter().map(|g| format!("{g:.0} GiB")).collect();
    let mut out = String::new();
    let _ = writeln!(
        out,
        "| measure | stasis at {} | slope / GiB | peer at {} | peer slope / GiB | growth |",
        sizes.join(", "),
        sizes.join(", ")
    );
    out.push_str("|---|---|---|---|---|---|\n");
    let mut faster = Vec::new();
    let values = |v: &[f64]| v.iter().map(|x| format!("{x:.0}")).collect::<Vec<_>>().join(" / ");
    for m in measures(points) {
        let growth = match (superlinear(&xs, &m.ours), m.judged) {
            (false, _) => "linear or less",
            (true, false) => "faster than linear (not judged)",
            (true, true) => {
                faster.push(m.name);
                "FASTER THAN LINEAR"
            }
        };
        let (theirs, their_slope) = match &m.theirs {
            Some(t) => (values(t), format!("{:.0}", slope(&xs, t))),
            None => ("—".into(), "—".into()),
        };
        let _ = writeln!(
            out,
            "| {}, {} | {} | {:.0} | {theirs} | {their_slope} | {growth} |",
            m.name,
            m.unit,
            values(&m.ours),
            slope(&xs, &m.ours),
        );
    }
    (out, faster)
}

/// Draws the curve into `path`: the times (seconds) against GiB, and stasisd's peak RSS.
pub fn svg(points: &[Point], path: &Path) -> anyhow::Result<()> {
    let xs = gib(points);
    // The disk bytes are context for the table, not a curve of this drawing's units.
    let all: Vec<Measure> = measures(points).into_iter().filter(|m| m.judged || m.unit == "ms").collect();
    let (times, memory): (Vec<&Measure>, Vec<&Measure>) = all.iter().partition(|m| m.unit == "ms");
    let root = SVGBackend::new(path, (1200, 1000)).into_drawing_area();
    root.fill(&WHITE)?;
    let (top, bottom) = root.split_vertically(700);
    let x_max = xs.last().copied().unwrap_or(1.0) * 1.05;
    let secs = |v: &[f64]| v.iter().map(|ms| ms / 1000.0).collect::<Vec<_>>();
    let y_max = times
        .iter()
        .flat_map(|m| m.ours.iter().chain(m.theirs.iter().flatten()))
        .fold(1.0f64, |a, b| a.max(b / 1000.0))
        * 1.1;
    let mut chart = ChartBuilder::on(&top)
        .caption("stasis (solid) and the peer pipeline (dashed): seconds against GiB", ("sans-serif", 22))
        .margin(15)
        .x_label_area_size(40)
        .y_label_area_size(60)
        .build_cartesian_2d(0.0..x_max, 0.0..y_max)?;
    chart.configure_mesh().x_desc("workload memory, GiB").y_desc("seconds").draw()?;
    for (i, m) in times.iter().enumerate() {
        let colour = Palette99::pick(i).to_rgba();
        let ours: Vec<(f64, f64)> = xs.iter().copied().zip(secs(&m.ours)).collect();
        chart
            .draw_series(LineSeries::new(ours.clone(), colour.stroke_width(2)))?
            .label(m.name)
            .legend(move |(x, y)| PathElement::new(vec![(x, y), (x + 20, y)], colour.stroke_width(2)));
        chart.draw_series(ours.iter().map(|&p| Circle::new(p, 3, colour.filled())))?;
        if let Some(theirs) = &m.theirs {
            let theirs: Vec<(f64, f64)> = xs.iter().copied().zip(secs(theirs)).collect();
            chart.draw_series(DashedLineSeries::new(theirs, 6, 4, colour.stroke_width(1)))?;
        }
    }
    chart.configure_series_labels().position(SeriesLabelPosition::UpperLeft).border_style(BLACK).draw()?;
    let rss_max = memory.iter().flat_map(|m| m.ours.iter()).fold(1.0f64, |a, &b| a.max(b)) * 1.1;
    let mut chart = ChartBuilder::on(&bottom)
        .caption("stasisd peak RSS, MiB", ("sans-serif", 18))
        .margin(15)
        .x_label_area_size(40)
        .y_label_area_size(60)
        .build_cartesian_2d(0.0..x_max, 0.0..rss_max)?;
    chart.configure_mesh().x_desc("workload memory, GiB").y_desc("MiB").draw()?;
    for m in memory {
        let ours: Vec<(f64, f64)> = xs.iter().copied().zip(m.ours.iter().copied()).collect();
        chart.draw_series(LineSeries::new(ours.clone(), BLACK.stroke_width(2)))?;
        chart.draw_series(ours.iter().map(|&p| Circle::new(p, 3, BLACK.filled())))?;
    }
    root.present()?;
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_straight_line_has_its_slope_and_is_linear() {
        let xs = [2.0, 8.0, 16.0];
        let ys: Vec<f64> = xs.iter().map(|x| 300.0 + 1000.0 * x).collect();
        assert!((slope(&xs, &ys) - 1000.0).abs() < 1e-6);
        assert!(!superlinear(&xs, &ys));
    }

    #[test]
    fn a_curve_that_steepens_grows_faster_than_linearly() {
        let xs = [2.0, 8.0, 16.0];
        assert!(superlinear(&xs, &[2000.0, 8000.0, 30_000.0]));
        // Steeper, but hardly growing: fixed costs and noise.
        assert!(!superlinear(&xs, &[100.0, 110.0, 300.0]));
        // Flattening is fine.
        assert!(!superlinear(&xs, &[2000.0, 8000.0, 12_000.0]));
    }
}
