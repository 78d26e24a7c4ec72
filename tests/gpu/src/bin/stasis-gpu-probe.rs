//! stasis-gpu-probe: drive `stasis_daemon::cuda` by hand on a GPU machine.
//!
//! ```text
//! stasis-gpu-probe gpus
//! stasis-gpu-probe state PID...          # running | locked | checkpointed | ... | no-cuda
//! stasis-gpu-probe candidates PID...     # the pids that have CUDA loaded (/proc only)
//! stasis-gpu-probe lock PID [--timeout-ms N] | checkpoint PID | restore PID [--map OLD=NEW]... | unlock PID
//! stasis-gpu-probe cycle PID [--pause-ms N] [--map OLD=NEW]...   # lock, checkpoint, restore, unlock
//! ```
//!
//! `RUST_LOG=debug` shows the module's own log lines (driver codes included).

#![forbid(unsafe_code)]

use std::process::ExitCode;
use std::time::{Duration, Instant};

use anyhow::{Context as _, Result, bail};
use clap::{Parser, Subcommand};
use stasis_daemon::cuda::{self, CudaDriver, GpuCheckpointer, GpuUuid, ProcessState};

#[derive(Debug, Parser)]
#[command(name = "stasis-gpu-probe")]
struct Args {
    #[command(subcommand)]
    command: Command,
}

#[derive(Debug, Subcommand)]
enum Command {
    /// Driver version and GPUs.
    Gpus,
    /// Checkpoint state of each pid.
    State { pids: Vec<i32> },
    /// Which pids have CUDA loaded, from /proc.
    Candidates { pids: Vec<i32> },
    /// The restore thread of a pid.
    RestoreTid { pid: i32 },
    /// RUNNING -> LOCKED.
    Lock {
        pid: i32,
        #[arg(long, default_value_t = 10_000)]
        timeout_ms: u32,
    },
    /// LOCKED -> CHECKPOINTED.
    Checkpoint { pid: i32 },
    /// CHECKPOINTED -> LOCKED, optionally onto other GPUs.
    Restore {
        pid: i32,
        /// OLD=NEW GPU UUIDs.
        #[arg(long = "map")]
        maps: Vec<String>,
    },
    /// LOCKED -> RUNNING.
    Unlock { pid: i32 },
    /// lock, checkpoint, wait, restore, unlock; unlocks again on any error.
    Cycle {
        pid: i32,
        #[arg(long, default_value_t = 10_000)]
        timeout_ms: u32,
        /// How long to stay checkpointed.
        #[arg(long, default_value_t = 0)]
        pause_ms: u64,
        /// OLD=NEW GPU UUIDs.
        #[arg(long = "map")]
        maps: Vec<String>,
    },
}

fn main() -> ExitCode {
    tracing_subscriber::fmt()
        .with_env_filter(
            tracing_subscriber::EnvFilter::try_from_default_env()
                .unwrap_or_else(|_| tracing_subscriber::EnvFilter::new("info")),
        )
        .with_writer(std::io::stderr)
        .init();
    match run(Args::parse().command) {
        Ok(()) => ExitCode::SUCCESS,
        Err(e) => {
            eprintln!("stasis-gpu-probe: {e:#}");
            ExitCode::from(1)
        }
    }
}

fn run(command: Command) -> Result<()> {
    if let Command::Candidates { pids } = &command {
        for pid in cuda::cuda_candidates(pids) {
            println!("{pid}");
        }
        return Ok(());
    }
    let driver = CudaDriver::load().context("loading the CUDA driver")?;
    match command {
        Command::Candidates { .. } => {}
        Command::Gpus => {
            println!("cuda {}", cuda::format_driver_version(driver.driver_version()));
            for g in driver.gpus()? {
                println!(
                    "{} {} {} {} MiB",
                    g.index,
                    cuda::format_uuid(&g.uuid),
                    g.name,
                    g.total_memory >> 20
                );
            }
        }
        Command::State { pids } => {
            for pid in pids {
                match driver.state(pid) {
                    Ok(Some(s)) => println!("pid {pid}: {s}"),
                    Ok(None) => println!("pid {pid}: no-cuda"),
                    Err(e) => println!("pid {pid}: error: {e}"),
                }
            }
        }
        Command::RestoreTid { pid } => match driver.restore_thread_id(pid)? {
            Some(tid) => println!("pid {pid}: restore tid {tid}"),
            None => println!("pid {pid}: no-cuda"),
        },
        Command::Lock { pid, timeout_ms } => timed("lock", || driver.lock(pid, timeout_ms))?,
        Command::Checkpoint { pid } => timed("checkpoint", || driver.checkpoint(pid))?,
        Command::Restore { pid, maps } => {
            let pairs = parse_maps(&maps)?;
            timed("restore", || driver.restore(pid, &pairs))?;
        }
        Command::Unlock { pid } => timed("unlock", || driver.unlock(pid))?,
        Command::Cycle { pid, timeout_ms, pause_ms, maps } => {
            let pairs = parse_maps(&maps)?;
            cycle(&driver, pid, timeout_ms, pause_ms, &pairs)?;
        }
    }
    Ok(())
}

fn cycle(
    d: &CudaDriver,
    pid: i32,
    timeout_ms: u32,
    pause_ms: u64,
    pairs: &[(GpuUuid, GpuUuid)],
) -> Result<()> {
    let show = |when: &str| match d.state(pid) {
        Ok(Some(s)) => println!("state {when}: {s}"),
        Ok(None) => println!("state {when}: no-cuda"),
        Err(e) => println!("state {when}: error: {e}"),
    };
    show("before");
    if d.state(pid)? != Some(ProcessState::Running) {
        bail!("pid {pid} is not a RUNNING CUDA process");
    }
    timed("lock", || d.lock(pid, timeout_ms))?;
    show("after lock");
    let checkpointed = timed("checkpoint", || d.checkpoint(pid));
    show("after checkpoint");
    if let Err(e) = checkpointed {
        let _ = d.unlock(pid);
        return Err(e);
    }
    std::thread::sleep(Duration::from_millis(pause_ms));
    let restored = timed("restore", || d.restore(pid, pairs));
    show("after restore");
    let unlocked = timed("unlock", || d.unlock(pid));
    show("after unlock");
    restored.and(unlocked)
}

fn timed(what: &str, f: impl FnOnce() -> Result<(), cuda::CudaError>) -> Result<()> {
    let start = Instant::now();
    let res = f();
    let ms = start.elapsed().as_secs_f64() * 1000.0;
    match &res {
        Ok(()) => println!("{what} ok in {ms:.1} ms"),
        Err(e) => println!("{what} FAILED in {ms:.1} ms: {e}"),
    }
    res.with_context(|| format!("{what} failed"))
}

fn parse_maps(maps: &[String]) -> Result<Vec<(GpuUuid, GpuUuid)>> {
    maps.iter()
        .map(|m| {
            let (old, new) = m.split_once('=').with_context(|| format!("--map {m}: expected OLD=NEW"))?;
            Ok((cuda::parse_uuid(old)?, cuda::parse_uuid(new)?))
        })
        .collect()
}
