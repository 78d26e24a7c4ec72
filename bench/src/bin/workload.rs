//! stasis-bench-workload: a process holding `--rss-mib` MiB of memory, a fraction random
//! (incompressible), a fraction compressible (text-like), the rest zero pages (touched, so
//! resident). It prints `ready`, then sleeps; on SIGUSR1 it rewrites `--dirty` of its memory
//! with new random bytes, in 1 MiB blocks spread evenly over the whole range (a training step
//! rewrites whole tensors, not scattered bytes), and prints `dirtied <bytes>`.
#![forbid(unsafe_code)]

use std::io::Write;
use std::time::Duration;

use anyhow::bail;
use clap::Parser;
use signal_hook::consts::SIGUSR1;
use signal_hook::iterator::Signals;

const BLOCK: usize = 1 << 20;

/// A process holding memory with given fractions of random, compressible and zero bytes.
#[derive(Debug, Parser)]
struct Args {
    /// Resident memory to hold, MiB.
    #[arg(long, default_value_t = 2048)]
    rss_mib: usize,
    /// Fraction of random (incompressible) bytes.
    #[arg(long, default_value_t = 0.5)]
    random: f64,
    /// Fraction of compressible (text-like) bytes; the rest is zero pages.
    #[arg(long, default_value_t = 0.5)]
    compressible: f64,
    /// Fraction rewritten on SIGUSR1.
    #[arg(long, default_value_t = 0.1)]
    dirty: f64,
}

/// xorshift64*: fast, and random enough that zstd cannot compress it.
fn fill_random(buf: &mut [u8], state: &mut u64) {
    for word in buf.chunks_mut(8) {
        *state ^= *state >> 12;
        *state ^= *state << 25;
        *state ^= *state >> 27;
        let v = state.wrapping_mul(0x2545_f491_4f6c_dd1d).to_le_bytes();
        word.copy_from_slice(&v[..word.len()]);
    }
}

fn fill_text(buf: &mut [u8], state: &mut u64) {
    const WORDS: [&[u8]; 8] =
        [b"tensor ", b"gradient ", b"layer ", b"weight ", b"0.0125 ", b"step ", b"loss ", b"\n"];
    let mut pos = 0;
    while pos < buf.len() {
        *state = state.wrapping_mul(6_364_136_223_846_793_005).wrapping_add(1);
        let w = WORDS[(*state >> 61) as usize];
        let n = w.len().min(buf.len() - pos);
        buf[pos..pos + n].copy_from_slice(&w[..n]);
        pos += n;
    }
}

fn main() -> anyhow::Result<()> {
    let args = Args::parse();
    if args.random + args.compressible > 1.0 || args.rss_mib == 0 {
        bail!("fractions must add up to at most 1 and the size must be positive");
    }
    let size = args.rss_mib << 20;
    let mut seed = u64::from(std::process::id()) | 1;
    let mut memory = vec![0u8; size];
    let random_end = (size as f64 * args.random) as usize;
    let text_end = random_end + (size as f64 * args.compressible) as usize;
    fill_random(&mut memory[..random_end], &mut seed);
    fill_text(&mut memory[random_end..text_end.min(size)], &mut seed);
    // Zero pages must be resident too: write them.
    for page in memory[text_end.min(size)..].chunks_mut(4096) {
        page[0] = 0;
        std::hint::black_box(&page[0]);
    }
    let mut signals = Signals::new([SIGUSR1])?;
    println!("ready");
    std::io::stdout().flush()?;
    let blocks = size / BLOCK;
    let dirty_blocks = ((blocks as f64) * args.dirty).round() as usize;
    for _ in signals.forever() {
        let stride = blocks / dirty_blocks.max(1);
        for i in 0..dirty_blocks {
            let at = i * stride * BLOCK;
            fill_random(&mut memory[at..at + BLOCK], &mut seed);
        }
        println!("dirtied {}", dirty_blocks * BLOCK);
        std::io::stdout().flush()?;
        std::thread::sleep(Duration::from_millis(1));
    }
    Ok(())
}
