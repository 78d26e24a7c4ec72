//! stasis-bench: measures stasis and the peer pipeline on the same synthetic workload in one
//! run and prints a table with ratios against issue 3's targets.
//!
//! Run as root from the repository root after `cargo build --release --workspace` and
//! `scripts/setup-criu.sh`:
//!
//! ```text
//! target/release/stasis-bench [--rss-mib 2048] [--random 0.5] [--compressible 0.5]
//!                             [--dirty 0.1] [--staging-mib N] [--store-dir /var/tmp/stasis-bench]
//! ```
#![forbid(unsafe_code)]

mod peer;
mod run;

use std::path::PathBuf;

use clap::Parser;

/// Measures stasis and the peer pipeline on one synthetic workload.
#[derive(Debug, Parser)]
pub struct Args {
    /// Resident memory of the workload, MiB.
    #[arg(long, default_value_t = 2048)]
    pub rss_mib: u64,
    /// Fraction of random (incompressible) memory.
    #[arg(long, default_value_t = 0.5)]
    pub random: f64,
    /// Fraction of compressible memory; the rest is zero pages.
    #[arg(long, default_value_t = 0.5)]
    pub compressible: f64,
    /// Fraction of memory rewritten between the two checkpoints.
    #[arg(long, default_value_t = 0.1)]
    pub dirty: f64,
    /// stasisd's staging bound, MiB (default: stasisd's own, a quarter of RAM).
    #[arg(long)]
    pub staging_mib: Option<u64>,
    /// Where the stores and scratch of the run go (a disk, not tmpfs).
    #[arg(long, default_value = "/var/tmp/stasis-bench")]
    pub store_dir: PathBuf,
}

fn main() -> anyhow::Result<()> {
    let args = Args::parse();
    let result = run::run(&args)?;
    println!("{}", result.table(&args));
    Ok(())
}
