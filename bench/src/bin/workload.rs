//! stasis-bench-workload: a process holding `--rss-mib` MiB of memory: a fraction random
//! (incompressible), a fraction compressible (text-like, ~4x with zstd -1), a fraction zero
//! pages (written, so resident); any rest is allocated but never touched. It prints `ready`,
//! then sleeps. On each SIGUSR1 it rewrites `--dirty` of its memory with new random bytes, in
//! contiguous blocks of `--dirty-block-kib` (default 1 MiB: a training step rewrites whole
//! tensors) spread evenly over the whole range, and prints `dirtied <N> pages <W> windows`
//! (N: pages rewritten in place; W: the 64 KiB-aligned address windows it wrote to, new
//! allocations included, since the previous SIGUSR1). With
//! `--churn` it also behaves like a Python or PyTorch process between two checkpoints: 4 KiB
//! writes scattered over its memory, new and freed heap allocations (small ones from the brk
//! heap, large ones as anonymous mappings that come and go). On each
//! SIGUSR2 it reads all of its memory and prints `checksum <hex>`; on each SIGHUP it reads its
//! working set and prints `touched <ms>`, the time that took: the blocks it rewrites, or with
//! `--working-set first` as much memory from the start of its range, read in order (model
//! weights or a read-mostly table: memory it mostly did not write since the last checkpoint),
//! with `strided` as many blocks halfway between the rewritten ones, with `random` as many
//! single pages anywhere.
#![forbid(unsafe_code)]

use std::io::Write;
use std::time::{SystemTime, UNIX_EPOCH};

use anyhow::{bail, ensure};
use clap::Parser;
use signal_hook::consts::{SIGHUP, SIGUSR1, SIGUSR2};
use signal_hook::iterator::Signals;

const PAGE: usize = 4096;

/// A process holding memory with given fractions of random, compressible and zero bytes.
#[derive(Debug, Parser)]
struct Args {
    /// Memory to hold, MiB.
    #[arg(long, default_value_t = 2048)]
    rss_mib: usize,
    /// Fraction of random (incompressible) bytes.
    #[arg(long, default_value_t = 0.5)]
    random: f64,
    /// Fraction of compressible (text-like) bytes.
    #[arg(long, default_value_t = 0.5)]
    compressible: f64,
    /// Fraction of zero pages, touched so they are resident [default: the rest].
    #[arg(long)]
    zero: Option<f64>,
    /// Fraction of the memory rewritten on each SIGUSR1.
    #[arg(long, default_value_t = 0.1)]
    dirty: f64,
    /// Size of each contiguous rewritten block, KiB (4: every k-th page).
    #[arg(long, default_value_t = 1024)]
    dirty_block_kib: usize,
    /// Also scatter 4 KiB writes and allocate and free heap memory on each SIGUSR1.
    #[arg(long)]
    churn: bool,
    /// What SIGHUP reads: `rewritten` (the blocks SIGUSR1 rewrites), `first` (as many bytes
    /// from the start of the memory, in order), `strided` (as many blocks, halfway between the
    /// rewritten ones) or `random` (as many pages, each anywhere).
    #[arg(long, default_value = "rewritten", value_parser = ["rewritten", "first", "strided", "random"])]
    working_set: String,
}

/// The granularity at which written memory is counted: the store's chunk windows.
const WINDOW: usize = 64 << 10;

/// Memory a churning process allocates and frees between checkpoints.
struct Churn {
    /// Large allocations (anonymous mappings, or brk heap once glibc raised its threshold).
    large: Vec<Vec<u8>>,
    /// Small allocations from the brk heap.
    small: Vec<Vec<u8>>,
}

impl Churn {
    fn new(seed: &mut u64) -> Churn {
        let mut churn = Churn { large: Vec::new(), small: Vec::new() };
        let mut windows = std::collections::HashSet::new();
        for _ in 0..4 {
            churn.step(seed, &mut windows);
        }
        churn
    }

    /// Frees the oldest large allocation and half the small ones, and makes new ones filled
    /// with random bytes; records the windows written.
    fn step(&mut self, seed: &mut u64, windows: &mut std::collections::HashSet<usize>) {
        if self.large.len() >= 4 {
            self.large.remove(0);
        }
        let size = (1 + next(seed) as usize % 8) << 20;
        self.large.push(filled(size, seed, windows));
        let keep = self.small.len() / 2;
        self.small.truncate(keep);
        for _ in 0..64 {
            let size = (4 + next(seed) as usize % 56) << 10;
            self.small.push(filled(size, seed, windows));
        }
    }
}

fn next(state: &mut u64) -> u64 {
    *state ^= *state >> 12;
    *state ^= *state << 25;
    *state ^= *state >> 27;
    state.wrapping_mul(0x2545_f491_4f6c_dd1d)
}

/// A new allocation of `size` random bytes; its windows go to `windows`.
fn filled(size: usize, seed: &mut u64, windows: &mut std::collections::HashSet<usize>) -> Vec<u8> {
    let mut v = vec![0u8; size];
    fill_random(&mut v, seed);
    mark(windows, v.as_ptr() as usize, size);
    v
}

/// Records that `len` bytes at address `addr` were written.
fn mark(windows: &mut std::collections::HashSet<usize>, addr: usize, len: usize) {
    windows.extend(addr / WINDOW..=(addr + len - 1) / WINDOW);
}

/// xorshift64*: fast, and random enough that zstd cannot compress it.
fn fill_random(buf: &mut [u8], state: &mut u64) {
    for word in buf.chunks_mut(8) {
        let v = next(state).to_le_bytes();
        word.copy_from_slice(&v[..word.len()]);
    }
}

/// A 64-bit digest of `buf` (multiply-xor over its words): cheap, and any changed word
/// changes it with overwhelming probability.
fn checksum(buf: &[u8]) -> u64 {
    buf.chunks(8).enumerate().fold(0x9e37_79b9_7f4a_7c15, |h: u64, (i, w)| {
        let mut word = [0u8; 8];
        word[..w.len()].copy_from_slice(w);
        (h ^ u64::from_le_bytes(word).wrapping_add(i as u64)).wrapping_mul(0x100_0000_01b3).rotate_left(29)
    })
}

/// Words from a small vocabulary, each followed by a number `0.ddd`: compresses about 4x with
/// zstd -1 (like text, logs or sparse tables).
fn fill_text(buf: &mut [u8], state: &mut u64) {
    const WORDS: [&[u8]; 8] =
        [b"tensor ", b"gradient ", b"layer ", b"weight ", b"step ", b"loss ", b"bias ", b"\n"];
    let mut item = [0u8; 16];
    let mut pos = 0;
    while pos < buf.len() {
        *state = state.wrapping_mul(6_364_136_223_846_793_005).wrapping_add(1);
        let word = WORDS[(*state >> 61) as usize];
        let num = ((*state >> 32) % 1000) as u32;
        let digit = |d: u32| b'0' + (d % 10) as u8;
        item[..word.len()].copy_from_slice(word);
        let n = word.len() + 6;
        item[word.len()..n].copy_from_slice(&[
            b'0',
            b'.',
            digit(num / 100),
            digit(num / 10),
            digit(num),
            b' ',
        ]);
        let n = n.min(buf.len() - pos);
        buf[pos..pos + n].copy_from_slice(&item[..n]);
        pos += n;
    }
}

fn main() -> anyhow::Result<()> {
    let args = Args::parse();
    let zero = args.zero.unwrap_or((1.0 - args.random - args.compressible).max(0.0));
    for f in [args.random, args.compressible, zero, args.dirty] {
        ensure!((0.0..=1.0).contains(&f), "fractions must be within 0..=1");
    }
    if args.random + args.compressible + zero > 1.0 + 1e-9 || args.rss_mib == 0 {
        bail!("fractions must add up to at most 1 and the size must be positive");
    }
    ensure!(args.dirty_block_kib >= 4 && args.dirty_block_kib % 4 == 0, "blocks are whole pages");
    let size = args.rss_mib << 20;
    let pages = |f: f64| (size as f64 * f / PAGE as f64) as usize * PAGE;
    let nanos = SystemTime::now().duration_since(UNIX_EPOCH).map(|d| d.as_nanos() as u64).unwrap_or(0);
    let mut seed = (u64::from(std::process::id()) << 32 ^ nanos) | 1;
    // Allocated zeroed (untouched pages are not resident until written).
    let mut memory = vec![0u8; size];
    let random_end = pages(args.random);
    let text_end = (random_end + pages(args.compressible)).min(size);
    let zero_end = (text_end + pages(zero)).min(size);
    fill_random(&mut memory[..random_end], &mut seed);
    fill_text(&mut memory[random_end..text_end], &mut seed);
    // Zero pages must be resident too: write a zero the compiler cannot prove redundant.
    for page in memory[text_end..zero_end].chunks_mut(PAGE) {
        page[0] = std::hint::black_box(0);
    }
    std::hint::black_box(&memory);
    let mut churn = args.churn.then(|| Churn::new(&mut seed));

    let mut signals = Signals::new([SIGUSR1, SIGUSR2, SIGHUP])?;
    println!("ready");
    std::io::stdout().flush()?;
    let block = args.dirty_block_kib << 10;
    let blocks = size / block;
    let dirty_blocks = ((blocks as f64) * args.dirty).round() as usize;
    // `forever` blocks in the signal pipe between signals: the process is idle while measured.
    let working_set = |i: usize| i * blocks / dirty_blocks * block;
    for signal in signals.forever() {
        if signal == SIGHUP {
            let started = std::time::Instant::now();
            let sum = match args.working_set.as_str() {
                "first" => memory[..dirty_blocks * block].iter().step_by(PAGE).fold(0u8, |a, b| a ^ b),
                "strided" => {
                    // Halfway between the rewritten blocks.
                    let offset = blocks / dirty_blocks.max(1) / 2 * block;
                    (0..dirty_blocks)
                        .map(|i| (working_set(i) + offset).min(size - block))
                        .flat_map(|at| memory[at..at + block].iter().step_by(PAGE))
                        .fold(0u8, |a, b| a ^ b)
                }
                "random" => {
                    let mut at = seed;
                    (0..dirty_blocks * block / PAGE)
                        .map(|_| memory[next(&mut at) as usize % (size / PAGE) * PAGE])
                        .fold(0u8, |a, b| a ^ b)
                }
                _ => (0..dirty_blocks)
                    .flat_map(|i| memory[working_set(i)..working_set(i) + block].iter().step_by(PAGE))
                    .fold(0u8, |a, b| a ^ b),
            };
            std::hint::black_box(sum);
            println!("touched {}", started.elapsed().as_millis());
            std::io::stdout().flush()?;
            continue;
        }
        if signal == SIGUSR2 {
            println!("checksum {:016x}", checksum(&memory));
            std::io::stdout().flush()?;
            continue;
        }
        let mut windows = std::collections::HashSet::new();
        let base = memory.as_ptr() as usize;
        for i in 0..dirty_blocks {
            let at = working_set(i);
            fill_random(&mut memory[at..at + block], &mut seed);
            mark(&mut windows, base + at, block);
        }
        let mut pages = dirty_blocks * block / PAGE;
        if let Some(churn) = churn.as_mut() {
            // One page in 256 gets a word written, anywhere.
            for _ in 0..size / PAGE / 256 {
                let at = next(&mut seed) as usize % (size / PAGE) * PAGE;
                memory[at..at + 8].copy_from_slice(&next(&mut seed).to_le_bytes());
                mark(&mut windows, base + at, 8);
                pages += 1;
            }
            churn.step(&mut seed, &mut windows);
        }
        std::hint::black_box(&memory);
        println!("dirtied {pages} pages {} windows", windows.len());
        std::io::stdout().flush()?;
    }
    Ok(())
}
