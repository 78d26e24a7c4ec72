//! stasis-bench: measures stasis and the peer pipeline (`criu dump` to tmpfs, then
//! `tar | zstd -1 -T0` into the same store) on the same synthetic workload in one run, and
//! prints a Markdown table with ratios against issue 3's targets.
//!
//! Run as root from the repository root after `cargo build --release --workspace` and
//! `scripts/setup-criu.sh`:
//!
//! ```text
//! target/release/stasis-bench [--rss-mib 2048] [--random 0.5] [--compressible 0.5] [--zero F]
//!     [--dirty 0.1] [--dirty-block-kib 1024] [--churn] [--rounds 3] [--staging-mib M]
//!     [--store-dir /var/tmp/stasis-bench] [--peer-scratch /dev/shm] [--no-settle] [--keep]
//! target/release/stasis-bench lazy [--s3] [--cold-store] [--prefetch fresh-first] [--eager-restore served] [the same options]
//! target/release/stasis-bench kube [the same options]
//! target/release/stasis-bench curve [--sizes-gib 2,8,16] [--svg bench/cost-curve.svg] [the same options]
//! ```
//!
//! `lazy` measures the lazy restore against the eager one and the peer's instead (see `lazy.rs`);
//! `kube` measures a Kubernetes pod's eviction and restart (see `kube.rs`); `curve` runs the
//! main and the lazy benchmark at several sizes and draws the cost curve (see `curve.rs`).
#![forbid(unsafe_code)]

mod curve;
mod daemon;
mod kube;
mod lazy;
mod peer;
mod report;
mod run;

use std::path::PathBuf;

use anyhow::{Context, ensure};
use clap::Parser;

/// Measures stasis and the peer pipeline on one synthetic workload.
#[derive(Debug, Parser)]
#[command(args_conflicts_with_subcommands = true)]
struct Cli {
    #[command(subcommand)]
    mode: Option<Mode>,
    #[command(flatten)]
    args: Args,
}

#[derive(Debug, clap::Subcommand)]
enum Mode {
    /// Lazy restore against eager restore of the same checkpoint.
    Lazy {
        /// Store checkpoints on the S3 test server (moto, from .stasis/venv) instead of a
        /// local directory.
        #[arg(long)]
        s3: bool,
        /// stasisd's `--lazy-prefetch` (address or fresh-first), to compare orders.
        #[arg(long, default_value = "fresh-first")]
        prefetch: String,
        /// stasisd's `--eager-restore` (served or files): the eager restore compared against.
        #[arg(long, default_value = "served")]
        eager_restore: String,
        #[command(flatten)]
        args: Args,
    },
    /// The main and the lazy benchmark at each size: the cost curve, as a table and an SVG.
    Curve {
        /// The workload's sizes, GiB, ascending.
        #[arg(long, value_delimiter = ',', default_value = "2,8,16")]
        sizes_gib: Vec<u64>,
        /// Where the SVG goes.
        #[arg(long, default_value = "bench/cost-curve.svg")]
        svg: PathBuf,
        #[command(flatten)]
        args: Args,
    },
    /// A Kubernetes pod's eviction (preStop until durable) against a cold full checkpoint,
    /// and its replacement's restart until the job runs (containerd via the CRI).
    Kube {
        #[command(flatten)]
        args: Args,
    },
}

/// The workload and the run.
#[derive(Debug, Clone, clap::Args)]
pub struct Args {
    /// Memory of the workload, MiB.
    #[arg(long, default_value_t = 2048)]
    pub rss_mib: u64,
    /// Fraction of random (incompressible) memory.
    #[arg(long, default_value_t = 0.5)]
    pub random: f64,
    /// Fraction of compressible (text-like, ~4x with zstd -1) memory.
    #[arg(long, default_value_t = 0.5)]
    pub compressible: f64,
    /// Fraction of zero pages, resident [default: the rest].
    #[arg(long)]
    pub zero: Option<f64>,
    /// Fraction of memory rewritten with new random bytes before each incremental checkpoint.
    #[arg(long, default_value_t = 0.1)]
    pub dirty: f64,
    /// Incremental checkpoints and restores measured each way (the order alternates; the table
    /// shows medians: this machine is noisy).
    #[arg(long, default_value_t = 3, value_parser = clap::value_parser!(u32).range(1..))]
    pub rounds: u32,
    /// Size of each rewritten block, KiB: 1024 rewrites whole 1 MiB blocks spread evenly,
    /// 4 every k-th page.
    #[arg(long, default_value_t = 1024)]
    pub dirty_block_kib: u64,
    /// Between checkpoints the workload also scatters 4 KiB writes and allocates and frees
    /// heap memory and anonymous mappings, as a Python or PyTorch process does.
    #[arg(long)]
    pub churn: bool,
    /// What the lazy mode's workload reads right after a --no-wait restore: `rewritten` (the
    /// blocks rewritten before the checkpoint: fresh in it), `first` (as much memory from the
    /// start of its range, in order: mostly not written since the checkpoint before),
    /// `strided` (as many blocks, halfway between the rewritten ones: not fresh either) or
    /// `random` (as many single pages, anywhere).
    #[arg(long, default_value = "rewritten", value_parser = ["rewritten", "first", "strided", "random"])]
    pub working_set: String,
    /// stasisd's staging bound, MiB [default: stasisd's own, a quarter of RAM].
    #[arg(long)]
    pub staging_mib: Option<u64>,
    /// How stasisd compresses new chunks [default: stasisd's own, zstd].
    #[arg(long, value_parser = ["zstd", "lz4"])]
    pub compression: Option<String>,
    /// The lazy benchmark drops a local store's files from the page cache before each restore
    /// (eager and lazy alike), so that every size reads the store from its disk, as a restore
    /// on another node does, instead of from memory while the packs fit beside the workload.
    #[arg(long)]
    pub cold_store: bool,
    /// Where the peer's image directories go: tmpfs, or a disk where the workload and its
    /// images would not fit in memory together.
    #[arg(long, default_value = "/dev/shm")]
    pub peer_scratch: PathBuf,
    /// Where the store, stasisd's state and the peer's tarballs go (a disk, not tmpfs).
    #[arg(long, default_value = "/var/tmp/stasis-bench")]
    pub store_dir: PathBuf,
    /// Measure back to back instead of letting the machine settle (flush writeback, wait 3 s)
    /// before each measured step.
    #[arg(long)]
    pub no_settle: bool,
    /// Keep the run's directory (stasisd's log and state, the store, the tarballs) afterwards.
    #[arg(long)]
    pub keep: bool,
}

impl Args {
    /// The fraction of zero pages: given, or what random and compressible leave.
    pub fn zero(&self) -> f64 {
        self.zero.unwrap_or((1.0 - self.random - self.compressible).max(0.0))
    }

    /// stasisd's flags for the settings these arguments give.
    pub fn daemon_flags(&self) -> Vec<String> {
        let mut flags = Vec::new();
        if let Some(mib) = self.staging_mib {
            flags.extend(["--staging-mib".into(), mib.to_string()]);
        }
        if let Some(c) = &self.compression {
            flags.extend(["--compression".into(), c.clone()]);
        }
        flags
    }
}

fn main() -> anyhow::Result<()> {
    let cli = Cli::parse();
    let (args, lazy) = match cli.mode {
        Some(Mode::Lazy { s3, prefetch, eager_restore, args }) => (args, Some((s3, prefetch, eager_restore))),
        Some(Mode::Kube { args }) => {
            ensure!(
                nix::unistd::geteuid().is_root(),
                "stasis-bench runs stasisd and containerd: run it as root"
            );
            let results = tokio::runtime::Runtime::new()?.block_on(kube::run(&args))?;
            return print_checked(&results.table(&args));
        }
        Some(Mode::Curve { sizes_gib, svg, args }) => return cost_curve(&args, &sizes_gib, &svg),
        None => (cli.args, None),
    };
    prepare(&args)?;
    match lazy {
        Some((s3, prefetch, eager)) => print_checked(&lazy::run(&args, s3, &prefetch, &eager)?.table(&args)),
        None => print_checked(&run::run(&args)?.table(&args)),
    }
}

/// Prints a run's table; fails the run when the table says a target was missed.
fn print_checked(table: &str) -> anyhow::Result<()> {
    println!("{table}");
    let missed = report::misses(table);
    ensure!(missed.is_empty(), "targets missed: {}", missed.join("; "));
    Ok(())
}

/// Checks `args` and gets the machine ready for a run.
fn prepare(args: &Args) -> anyhow::Result<()> {
    ensure!(args.random + args.compressible + args.zero() <= 1.0 + 1e-9, "fractions add up to more than 1");
    ensure!(
        args.dirty_block_kib >= 4 && args.dirty_block_kib.is_multiple_of(4),
        "--dirty-block-kib: whole pages"
    );
    ensure!(nix::unistd::geteuid().is_root(), "stasis-bench runs stasisd and CRIU: run it as root");
    daemon::SETTLE.store(!args.no_settle, std::sync::atomic::Ordering::Relaxed);
    daemon::undo_on_signals()
}

/// `stasis-bench curve`: both benchmarks' tables at each size, then the curve's table and SVG;
/// fails when a stasis measure grows faster than linearly.
fn cost_curve(args: &Args, sizes_gib: &[u64], svg: &std::path::Path) -> anyhow::Result<()> {
    ensure!(
        sizes_gib.len() >= 2 && sizes_gib.is_sorted() && sizes_gib[0] > 0,
        "--sizes-gib: at least two sizes, ascending"
    );
    prepare(args)?;
    let sizes: Vec<u64> = sizes_gib.iter().map(|g| g << 10).collect();
    let points = curve::run(args, &sizes)?;
    let mut missed = Vec::new();
    for p in &points {
        let args = Args { rss_mib: p.mib, ..args.clone() };
        let tables = format!("{}\n{}", p.main.table(&args), p.lazy.table(&args));
        println!("### {} GiB\n\n{tables}", p.mib >> 10);
        missed.extend(report::misses(&tables).into_iter().map(|m| format!("{m} ({} GiB)", p.mib >> 10)));
    }
    let (table, faster) = curve::table(&points);
    println!("### Cost curve\n\n{table}");
    curve::svg(&points, svg).with_context(|| format!("drawing {}", svg.display()))?;
    println!("drawn: {}", svg.display());
    ensure!(faster.is_empty(), "growing faster than linearly: {}", faster.join("; "));
    ensure!(missed.is_empty(), "targets missed: {}", missed.join("; "));
    Ok(())
}
