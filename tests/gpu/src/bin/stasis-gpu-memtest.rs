//! stasis-gpu-memtest: device memory with a known pattern, verified periodically.
//!
//! Allocates `--gib` GiB with `cuMemAlloc`, fills it with generation 0 of the pattern by a
//! kernel, prints `ready gib=N checksum=<hex>`, then every `--period-ms` verifies it by a
//! kernel and prints `verify ok gen=G checksum=<hex>` (or `verify FAILED at word W ...` and
//! exits 2). Without `--hold` it then rewrites the memory as generation G+1 and prints
//! `step G+1`, so memory changes over time; with `--hold` the memory and so the checksum stay
//! constant, which is what a checkpoint/restore test compares. `--churn-gib G` adds a second
//! buffer of G GiB (its own seed) that is rewritten with its next generation every period, held
//! or not, and verified before each rewrite (`churn ok gen=G`): a job that changes a known part
//! of its device memory between checkpoints. Any CUDA error: a message on stderr and exit
//! status 1.

#![forbid(unsafe_code)]

use std::io::Write as _;
use std::process::ExitCode;
use std::time::Duration;

use clap::Parser;
use stasis_gpu_tests::pattern::PTX;
use stasis_gpu_tests::sys::{Gpu, GpuError};

/// Fill GPU memory with a known pattern and verify it periodically.
#[derive(Debug, Parser)]
#[command(name = "stasis-gpu-memtest")]
struct Args {
    /// GiB of device memory to allocate (fractions allowed).
    #[arg(long, default_value_t = 1.0)]
    gib: f64,
    /// Milliseconds between verifications.
    #[arg(long, default_value_t = 500)]
    period_ms: u64,
    /// Fill once, then only verify (the checksum stays constant).
    #[arg(long)]
    hold: bool,
    /// Seed of the pattern.
    #[arg(long, default_value_t = 0x5eed_1234)]
    seed: u32,
    /// CUDA device ordinal.
    #[arg(long, default_value_t = 0)]
    device: i32,
    /// Stop after this many verifications (0: run until killed).
    #[arg(long, default_value_t = 0)]
    iterations: u64,
    /// GiB of a second buffer rewritten every period (0: none).
    #[arg(long, default_value_t = 0.0)]
    churn_gib: f64,
}

fn main() -> ExitCode {
    // A panic (e.g. a driver symbol missing) must still end with status 1 and a message.
    std::panic::set_hook(Box::new(|info| {
        eprintln!("stasis-gpu-memtest: internal error: {info}");
        std::process::exit(1);
    }));
    let args = Args::parse();
    match run(&args) {
        Ok(code) => code,
        Err(e) => {
            eprintln!("stasis-gpu-memtest: {e}");
            ExitCode::from(1)
        }
    }
}

/// Prints one line and flushes it; a closed stdout ends the program.
fn say(line: std::fmt::Arguments<'_>) {
    let mut out = std::io::stdout().lock();
    if writeln!(out, "{line}").and_then(|()| out.flush()).is_err() {
        std::process::exit(1);
    }
}

fn run(args: &Args) -> Result<ExitCode, GpuError> {
    let words = words_for(args.gib);
    if words == 0 {
        eprintln!("stasis-gpu-memtest: --gib must be positive and at most 1024");
        return Ok(ExitCode::from(1));
    }
    let gpu = Gpu::open(args.device, PTX)?;
    eprintln!(
        "stasis-gpu-memtest: device {} ({}), {} words, pid {}",
        args.device,
        gpu.name(),
        words,
        std::process::id()
    );
    let buf = gpu.alloc_words(words)?;
    let mut generation = 0u32;
    gpu.fill(&buf, args.seed, generation)?;
    let first = gpu.verify(&buf, args.seed, generation)?;
    if let Some(w) = first.first_bad {
        say(format_args!("verify FAILED at word {w} gen={generation} mismatches={}", first.mismatches));
        return Ok(ExitCode::from(2));
    }
    let churn_seed = !args.seed;
    let churn = match words_for(args.churn_gib) {
        0 if args.churn_gib > 0.0 => {
            eprintln!("stasis-gpu-memtest: --churn-gib must be at most 1024");
            return Ok(ExitCode::from(1));
        }
        0 => None,
        words => {
            let churn = gpu.alloc_words(words)?;
            gpu.fill(&churn, churn_seed, 0)?;
            Some(churn)
        }
    };
    say(format_args!("{}", ready_line(args.gib, first.checksum)));

    let mut done = 0u64;
    let mut churn_generation = 0u32;
    while args.iterations == 0 || done < args.iterations {
        std::thread::sleep(Duration::from_millis(args.period_ms));
        let v = gpu.verify(&buf, args.seed, generation)?;
        done += 1;
        if let Some(w) = v.first_bad {
            say(format_args!("verify FAILED at word {w} gen={generation} mismatches={}", v.mismatches));
            return Ok(ExitCode::from(2));
        }
        say(format_args!("verify ok gen={generation} checksum={:016x}", v.checksum));
        if let Some(churn) = &churn {
            let c = gpu.verify(churn, churn_seed, churn_generation)?;
            if let Some(w) = c.first_bad {
                say(format_args!(
                    "churn FAILED at word {w} gen={churn_generation} mismatches={}",
                    c.mismatches
                ));
                return Ok(ExitCode::from(2));
            }
            churn_generation = churn_generation.wrapping_add(1);
            gpu.fill(churn, churn_seed, churn_generation)?;
            say(format_args!("churn ok gen={churn_generation}"));
        }
        if !args.hold {
            generation = generation.wrapping_add(1);
            gpu.fill(&buf, args.seed, generation)?;
            say(format_args!("step {generation}"));
        }
    }
    Ok(ExitCode::SUCCESS)
}

/// The line saying the memory is filled: `--gib` as given (`1`, not `1.0`), the checksum in
/// 16 hex digits.
fn ready_line(gib: f64, checksum: u64) -> String {
    format!("ready gib={gib} checksum={checksum:016x}")
}

/// u32 words in `gib` GiB; 0 for a size out of range.
fn words_for(gib: f64) -> u64 {
    if !(gib > 0.0 && gib <= 1024.0) {
        return 0;
    }
    // In range by the check above: at most 2^38 words.
    (gib * f64::from(1u32 << 30) / 4.0) as u64
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn sizes() {
        assert_eq!(words_for(1.0), 1 << 28);
        assert_eq!(words_for(0.25), 1 << 26);
        assert_eq!(words_for(0.0), 0);
        assert_eq!(words_for(-1.0), 0);
        assert_eq!(words_for(f64::NAN), 0);
        assert_eq!(words_for(4096.0), 0);
    }

    #[test]
    fn ready_line_prints_gib_as_given() {
        assert_eq!(ready_line(1.0, 255), "ready gib=1 checksum=00000000000000ff");
        assert_eq!(ready_line(0.25, u64::MAX), "ready gib=0.25 checksum=ffffffffffffffff");
    }
}
