//! stasis-lazy-guard: keeps a lazily restored tree from running on memory that never arrived.
//!
//! stasisd starts it with every restore whose memory it serves, with one end of a
//! SOCK_SEQPACKET socket as stdin. When the tree is about to run, stasisd sends it `h` and the
//! tree's pids (root first, comma-separated) with copies of the tree's userfaultfds, and later
//! `a` with those of processes the tree forks. While it holds them, a fault on a page that has
//! not arrived waits, even if the server in stasisd is gone (without a holder the kernel would
//! fill the page with zeros). When stasisd is done (all memory resident, or the tree already
//! killed) it sends `r`: the guard exits and lets the descriptors go. If the socket closes
//! without that while it holds descriptors, stasisd died mid-way: the guard kills the tree,
//! then exits.
//!
//! It runs in its own session and keeps SIGTERM, SIGINT and SIGHUP blocked, so signals meant
//! for stasisd (a service stop that first lets running restores finish) do not take it down.
#![forbid(unsafe_code)]

use std::os::fd::{AsFd, AsRawFd, OwnedFd};

use anyhow::Context;
use nix::poll::{PollFd, PollFlags, PollTimeout, poll};
use nix::sys::signal::{SigSet, Signal};
use nix::sys::socket::{MsgFlags, send};
use stasis_daemon::linux::proc;
use stasis_daemon::linux::sys::recv_with_fds;

fn main() -> anyhow::Result<()> {
    // Its own session: signals to stasisd's process group or session are not for it.
    let _ = nix::unistd::setsid();
    let mut blocked = SigSet::empty();
    for signal in [Signal::SIGTERM, Signal::SIGINT, Signal::SIGHUP] {
        blocked.add(signal);
    }
    blocked.thread_block().context("blocking signals")?;
    let stdin = std::io::stdin();
    let channel = stdin.as_fd();
    let mut held: Vec<OwnedFd> = Vec::new();
    let mut pids: Vec<i32> = Vec::new();
    let mut buf = vec![0u8; 1 << 16];
    loop {
        let mut fds = [PollFd::new(channel, PollFlags::POLLIN)];
        if poll(&mut fds, PollTimeout::NONE).is_err() {
            continue;
        }
        let (n, fds) = match recv_with_fds(channel, &mut buf) {
            Ok(Some(received)) => received,
            Ok(None) => continue,
            Err(_) => (0, Vec::new()),
        };
        held.extend(fds);
        match buf[..n].split_first() {
            Some((b'h', list)) => {
                pids = String::from_utf8_lossy(list).split(',').filter_map(|p| p.parse().ok()).collect();
                send(channel.as_raw_fd(), b"k", MsgFlags::MSG_NOSIGNAL).context("answering stasisd")?;
            }
            Some((b'a', _)) => {}
            Some((b'r', _)) => return Ok(()),
            // The end of the stream: stasisd is gone.
            None => break,
            Some(_) => {}
        }
    }
    if !held.is_empty() && !pids.is_empty() {
        let mut all = proc::process_tree(pids[0]).unwrap_or_default();
        all.extend(&pids);
        proc::signal_all(&all, Signal::SIGKILL);
        eprintln!("stasis-lazy-guard: stasisd went away during a lazy restore; killed pids {all:?}");
    }
    Ok(())
}
