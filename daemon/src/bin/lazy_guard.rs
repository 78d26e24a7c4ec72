//! stasis-lazy-guard: keeps a lazily restored tree from running on memory that never arrived.
//!
//! stasisd starts it when a lazily restored tree is about to run, handing it copies of the
//! tree's userfaultfds (as inherited descriptors) and a control pipe as stdin. While
//! it holds them, a fault on a page that has not arrived waits, even if CRIU's lazy-pages
//! daemon dies (without a holder the kernel would fill the page with zeros). When stasisd is
//! done (all memory resident, or the tree already killed) it writes a byte: the guard exits
//! and lets the descriptors go. If the pipe closes without that byte, stasisd died mid-way:
//! the guard kills the tree, then exits.
//!
//! It runs in its own session and keeps SIGTERM, SIGINT and SIGHUP blocked, so signals meant
//! for stasisd (a service stop that first lets running restores finish) do not take it down.
#![forbid(unsafe_code)]

use std::io::Read;

use anyhow::Context;
use clap::Parser;
use nix::sys::signal::{SigSet, Signal};
use stasis_daemon::linux::proc;

/// Guards a lazily restored process tree (started by stasisd, not by hand).
#[derive(Debug, Parser)]
#[command(version, about)]
struct Args {
    /// Root of the restored tree.
    #[arg(long)]
    root: i32,
    /// Processes of the restored tree (besides the root's descendants).
    #[arg(long, value_delimiter = ',')]
    pids: Vec<i32>,
}

fn main() -> anyhow::Result<()> {
    let args = Args::parse();
    let mut blocked = SigSet::empty();
    for signal in [Signal::SIGTERM, Signal::SIGINT, Signal::SIGHUP] {
        blocked.add(signal);
    }
    blocked.thread_block().context("blocking signals")?;
    let mut byte = [0u8; 1];
    let released = matches!(std::io::stdin().read(&mut byte), Ok(1));
    if !released {
        let mut pids = proc::process_tree(args.root).unwrap_or_default();
        pids.extend(&args.pids);
        proc::signal_all(&pids, Signal::SIGKILL);
        eprintln!("stasis-lazy-guard: stasisd went away during a lazy restore; killed pids {pids:?}");
    }
    Ok(())
}
