//! stasis-bench-workload: a process holding `--rss-mib` MiB of memory, a fraction random
//! (incompressible), a fraction compressible (text-like), the rest zero pages (touched, so
//! resident). It prints `ready`, then sleeps; on SIGUSR1 it rewrites `--dirty` of its memory
//! with new random bytes, in 1 MiB blocks spread evenly over the whole range (a training step
//! rewrites whole tensors, not scattered bytes), and prints `dirtied <bytes>`.
#![forbid(unsafe_code)]

use std::io::Write;
use std::time::Duration;

use anyhow::{Context, bail};
use signal_hook::consts::SIGUSR1;
use signal_hook::iterator::Signals;

const BLOCK: usize = 1 << 20;

struct Args {
    rss_mib: usize,
    random: f64,
    compressible: f64,
    dirty: f64,
}

fn parse() -> anyhow::Result<Args> {
    let mut a = Args { rss_mib: 2048, random: 0.5, compressible: 0.5, dirty: 0.1 };
    let mut it = std::env::args().skip(1);
    while let Some(flag) = it.next() {
        let value = it.next().with_context(|| format!("{flag} needs a value"))?;
        match flag.as_str() {
            "--rss-mib" => a.rss_mib = value.parse()?,
            "--random" => a.random = value.parse()?,
            "--compressible" => a.compressible = value.parse()?,
            "--dirty" => a.dirty = value.parse()?,
            other => bail!("unknown flag {other}"),
        }
    }
    if a.random + a.compressible > 1.0 || a.rss_mib == 0 {
        bail!("fractions must add up to at most 1 and the size must be positive");
    }
    Ok(a)
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
    let args = parse()?;
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
