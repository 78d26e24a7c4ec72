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

use anyhow::{Context, bail};

pub struct Args {
    pub rss_mib: u64,
    pub random: f64,
    pub compressible: f64,
    pub dirty: f64,
    pub staging_mib: Option<u64>,
    pub store_dir: PathBuf,
}

fn parse() -> anyhow::Result<Args> {
    let mut a = Args {
        rss_mib: 2048,
        random: 0.5,
        compressible: 0.5,
        dirty: 0.1,
        staging_mib: None,
        store_dir: "/var/tmp/stasis-bench".into(),
    };
    let mut it = std::env::args().skip(1);
    while let Some(flag) = it.next() {
        let value = it.next().with_context(|| format!("{flag} needs a value"))?;
        match flag.as_str() {
            "--rss-mib" => a.rss_mib = value.parse()?,
            "--random" => a.random = value.parse()?,
            "--compressible" => a.compressible = value.parse()?,
            "--dirty" => a.dirty = value.parse()?,
            "--staging-mib" => a.staging_mib = Some(value.parse()?),
            "--store-dir" => a.store_dir = value.into(),
            other => bail!("unknown flag {other}"),
        }
    }
    Ok(a)
}

fn main() -> anyhow::Result<()> {
    let args = parse()?;
    let result = run::run(&args)?;
    println!("{}", result.table(&args));
    Ok(())
}
