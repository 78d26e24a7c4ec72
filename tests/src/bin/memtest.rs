//! stasis-memtest: a multi-threaded memory workload whose memory can be verified across a
//! checkpoint and restore.
//!
//! Usage: `stasis-memtest [THREADS (default 4)] [MIB PER THREAD (default 16)]`.
//!
//! Each thread owns a region of MIB MiB and keeps overwriting it with its own xorshift
//! sequence, one batch at a time, counting batches ("iterations"). Output, flushed after each
//! line:
//! - `ready` once every region has been written completely;
//! - on SIGUSR1 while running: every thread parks between two batches, then
//!   `paused checksum=<16 hex digits> iterations=<total batches>`, the checksum being 64-bit
//!   FNV-1a over the 64-bit words of all regions in thread order;
//! - on SIGUSR1 while paused: the threads go on, and `resumed`;
//! - on SIGUSR2 while paused: `checksum=<hex>` again (computed afresh from memory).

#![forbid(unsafe_code)]

use std::io::Write as _;
use std::sync::atomic::{AtomicU64, AtomicUsize, Ordering};
use std::sync::{Arc, Condvar, Mutex};

use signal_hook::consts::{SIGUSR1, SIGUSR2};
use signal_hook::iterator::Signals;

/// Words written per batch: 512 KiB, so a pause waits at most for that much work.
const BATCH: usize = 64 * 1024;

const FNV_OFFSET: u64 = 0xcbf2_9ce4_8422_2325;
const FNV_PRIME: u64 = 0x0000_0100_0000_01b3;

/// Pause control shared by all threads.
struct Control {
    state: Mutex<PauseState>,
    changed: Condvar,
}

#[derive(Default)]
struct PauseState {
    paused: bool,
    parked: usize,
}

struct Worker {
    region: Mutex<Vec<u64>>,
    iterations: AtomicU64,
}

fn say(line: &str) {
    let mut out = std::io::stdout().lock();
    // A closed stdout leaves nothing useful to do but stop.
    if writeln!(out, "{line}").and_then(|()| out.flush()).is_err() {
        std::process::exit(1);
    }
}

fn arg(n: usize, default: usize) -> usize {
    match std::env::args().nth(n) {
        None => default,
        Some(text) => text.parse().unwrap_or_else(|_| {
            eprintln!("usage: stasis-memtest [THREADS] [MIB PER THREAD]");
            std::process::exit(2)
        }),
    }
}

/// Parks the calling thread while the workload is paused.
fn safe_point(control: &Control) {
    let mut state = control.state.lock().expect("pause state");
    if !state.paused {
        return;
    }
    state.parked += 1;
    control.changed.notify_all();
    while state.paused {
        state = control.changed.wait(state).expect("pause state");
    }
    state.parked -= 1;
}

fn work(index: usize, worker: &Worker, control: &Control, filled: &AtomicUsize, threads: usize) {
    let mut x: u64 = 0x9e37_79b9_7f4a_7c15 ^ (index as u64 + 1).wrapping_mul(0x2545_f491_4f6c_dd1d);
    let mut pos = 0;
    let mut full = false;
    loop {
        safe_point(control);
        {
            let mut region = worker.region.lock().expect("region");
            let len = region.len();
            let end = (pos + BATCH).min(len);
            for word in &mut region[pos..end] {
                x ^= x << 13;
                x ^= x >> 7;
                x ^= x << 17;
                *word = x;
            }
            pos = if end == len { 0 } else { end };
            if pos == 0 && !full {
                full = true;
                if filled.fetch_add(1, Ordering::SeqCst) + 1 == threads {
                    say("ready");
                }
            }
        }
        worker.iterations.fetch_add(1, Ordering::SeqCst);
    }
}

fn checksum(workers: &[Arc<Worker>]) -> u64 {
    let mut hash = FNV_OFFSET;
    for worker in workers {
        for word in worker.region.lock().expect("region").iter() {
            hash ^= *word;
            hash = hash.wrapping_mul(FNV_PRIME);
        }
    }
    hash
}

fn main() {
    let threads = arg(1, 4).max(1);
    let mib = arg(2, 16).max(1);
    let words = mib * 1024 * 1024 / 8;

    let mut signals = Signals::new([SIGUSR1, SIGUSR2]).expect("installing signal handlers");
    let control = Arc::new(Control { state: Mutex::new(PauseState::default()), changed: Condvar::new() });
    let filled = Arc::new(AtomicUsize::new(0));
    let workers: Vec<Arc<Worker>> = (0..threads)
        .map(|_| Arc::new(Worker { region: Mutex::new(vec![0; words]), iterations: AtomicU64::new(0) }))
        .collect();
    for (index, worker) in workers.iter().enumerate() {
        let (worker, control, filled) = (worker.clone(), control.clone(), filled.clone());
        std::thread::Builder::new()
            .name(format!("memtest-{index}"))
            .spawn(move || work(index, &worker, &control, &filled, threads))
            .expect("starting a worker thread");
    }

    for signal in signals.forever() {
        let mut state = control.state.lock().expect("pause state");
        match (signal, state.paused) {
            (SIGUSR1, false) => {
                state.paused = true;
                while state.parked < threads {
                    state = control.changed.wait(state).expect("pause state");
                }
                drop(state);
                let iterations: u64 = workers.iter().map(|w| w.iterations.load(Ordering::SeqCst)).sum();
                say(&format!("paused checksum={:016x} iterations={iterations}", checksum(&workers)));
            }
            (SIGUSR1, true) => {
                state.paused = false;
                control.changed.notify_all();
                drop(state);
                say("resumed");
            }
            (SIGUSR2, true) => {
                drop(state);
                say(&format!("checksum={:016x}", checksum(&workers)));
            }
            _ => {}
        }
    }
}
