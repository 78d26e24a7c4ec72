//! Noticing that a workload whose connections are locked (during its reclaim's dump, and
//! while it is reclaimed) is being used: a peer sends it data, or opens or closes a
//! connection.
//!
//! While the tree runs, two ways, for two kinds of peer:
//! - Peers on other nodes (or in other network namespaces of this one): their segments reach
//!   this namespace through an interface, where a packet socket sees them before CRIU's lock
//!   drops them ([`Watches::watch_ports`]).
//! - Peers in this network namespace (a Jupyter server and its kernels on one node talk over
//!   loopback): CRIU's lock drops their segments on the way out, in netfilter's output hook,
//!   so no interface ever carries them. Their own sockets tell instead: a peer that wrote
//!   bytes the workload has not acknowledged, or that closed its end, wants something. Those
//!   sockets are polled through sock_diag.
//!
//! A request that came before the watch began is found once the dump has stopped the tree
//! ([`ReclaimUses::at_stop`]): still unread in a socket, or being served by a thread the dump
//! caught at work.

use std::collections::HashMap;
use std::net::SocketAddr;
use std::path::Path;
use std::sync::atomic::{AtomicBool, Ordering};
use std::time::Duration;

use tracing::{debug, warn};

use crate::criu::running::running_threads;
use crate::engine::host::{Host, PortUses, TcpSockets, Watches};
use crate::linux::net::WaitingInput;
use crate::linux::sock_diag::TCP_ESTABLISHED;

/// What an idle reclaim knows of its workload's uses while the checkpoint runs.
#[derive(Debug, Default)]
pub struct ReclaimUses {
    /// Set once a use is seen while the tree runs (see [`UseWatch`]).
    pub seen: AtomicBool,
    /// Bytes the tree's connections held unread as the reclaim began, by socket inode: what
    /// was unread then and is still is input the program leaves there, not a request.
    unread_before: HashMap<u64, u32>,
}

impl ReclaimUses {
    /// Uses of a tree whose sockets hold `waiting` as its reclaim begins.
    pub fn new(waiting: &[WaitingInput]) -> ReclaimUses {
        let unread_before =
            waiting.iter().filter(|w| w.remote.is_some()).map(|w| (w.inode, w.queued)).collect();
        ReclaimUses { seen: AtomicBool::new(false), unread_before }
    }

    /// Why the workload counts as used, asked once its dump (images in `images`) has stopped
    /// tree `pids`: a use seen meanwhile; a connection waiting to be accepted, or bytes that
    /// came during the reclaim unread; or a thread stopped outside a system call, serving a
    /// request that came before the watch. `None`: nobody waits for it.
    pub fn at_stop(&self, host: &dyn Host, pids: &[i32], images: &Path) -> Option<String> {
        if self.seen.load(Ordering::SeqCst) {
            return Some("it was used during the reclaim".into());
        }
        let came = |w: &WaitingInput| {
            w.remote.is_none() || w.queued > self.unread_before.get(&w.inode).copied().unwrap_or(0)
        };
        let waiting: Vec<String> =
            host.waiting_input(pids).iter().filter(|w| came(w)).map(describe).collect();
        if !waiting.is_empty() {
            return Some(format!("input waits to be taken: {}", waiting.join(", ")));
        }
        match running_threads(images) {
            Ok(running) if !running.is_empty() => Some(format!(
                "threads {running:?} were at work (outside a system call) when the dump stopped them"
            )),
            Ok(_) => None,
            Err(e) => {
                warn!(error = %e, "cannot tell from the dump whether the workload was at work; taken as idle");
                None
            }
        }
    }
}

/// "3 connections waiting on 127.0.0.1:80", "120 bytes unread from 10.0.0.9:5432".
fn describe(w: &WaitingInput) -> String {
    match w.remote {
        None => format!("{} connections waiting on {}", w.queued, w.local),
        Some(remote) => format!("{} bytes unread from {remote} on {}", w.queued, w.local),
    }
}

/// How often the sockets of peers on this node are looked at.
const PEER_POLL: Duration = Duration::from_millis(50);

/// A watch on the uses of one workload.
pub(super) struct UseWatch {
    segments: Option<Box<dyn PortUses>>,
    peers: Option<LocalPeers>,
}

impl UseWatch {
    /// Watches segments to `ports`, and the peers on this node of `connections` (the
    /// workload's established TCP connections, as `(local, remote)`). What cannot be watched
    /// is logged, naming `while_`.
    pub fn open(
        host: &dyn Watches,
        name: &str,
        ports: &[u16],
        connections: &[(SocketAddr, SocketAddr)],
        while_: &str,
    ) -> UseWatch {
        let segments = (!ports.is_empty())
            .then(|| host.watch_ports(ports))
            .transpose()
            .inspect_err(|e| warn!(workload = name, error = %e, "cannot watch the workload's ports {while_}"))
            .ok()
            .flatten();
        let peers = LocalPeers::find(host, connections)
            .inspect_err(|e| warn!(workload = name, error = %e, "cannot watch the workload's peers on this node {while_}"))
            .ok()
            .flatten();
        UseWatch { segments, peers }
    }

    /// Waits for the next use; returns the workload's port it concerns. Never returns when
    /// nothing can be watched.
    pub async fn next(&mut self) -> u16 {
        let segments = async {
            let Some(watch) = &self.segments else { return std::future::pending().await };
            match watch.next().await {
                Ok(port) => port,
                Err(e) => {
                    warn!(error = %e, "watching a workload's ports failed");
                    std::future::pending().await
                }
            }
        };
        let peers = async {
            let Some(peers) = &mut self.peers else { return std::future::pending().await };
            peers.next().await
        };
        tokio::select! {
            port = segments => port,
            port = peers => port,
        }
    }
}

/// The connections of a workload whose other end is a socket of this network namespace.
struct LocalPeers {
    diag: Box<dyn TcpSockets>,
    connections: Vec<(SocketAddr, SocketAddr)>,
}

impl LocalPeers {
    /// Those of `connections` whose peer is here (`None` if none is).
    fn find(
        host: &dyn Watches,
        connections: &[(SocketAddr, SocketAddr)],
    ) -> std::io::Result<Option<LocalPeers>> {
        if connections.is_empty() {
            return Ok(None);
        }
        let mut diag = host.tcp_sockets()?;
        let mut here = Vec::new();
        for &(local, remote) in connections {
            if diag.tcp(remote, local)?.is_some() {
                here.push((local, remote));
            }
        }
        Ok((!here.is_empty()).then_some(LocalPeers { diag, connections: here }))
    }

    /// Polls until a peer has written bytes the workload has not acknowledged, or left the
    /// established state (closing, or gone); returns the workload's port of that connection.
    async fn next(&mut self) -> u16 {
        loop {
            for &(local, remote) in &self.connections {
                match self.diag.tcp(remote, local) {
                    Ok(Some(peer)) if peer.state == TCP_ESTABLISHED && peer.unacked == 0 => {}
                    Ok(peer) => {
                        debug!(local = %local, remote = %remote, ?peer, "a peer on this node wants the workload");
                        return local.port();
                    }
                    Err(e) => debug!(error = %e, "looking at a peer's socket failed; trying again"),
                }
            }
            tokio::time::sleep(PEER_POLL).await;
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::engine::host::fake::FakeHost;
    use crate::engine::idle::tests::input;
    use stasis_criu_images::testing::{catch_running, write_dump_images};

    /// Why a reclaim of a tree whose sockets hold `survey`, then `stop`, and whose dump
    /// caught it at work (`running`), backs off.
    fn why(survey: Vec<WaitingInput>, stop: Vec<WaitingInput>, running: bool) -> Option<String> {
        let host = FakeHost::default();
        host.waiting_input.lock().unwrap().extend([survey, stop]);
        let uses = ReclaimUses::new(&host.waiting_input(&[1]));
        let images = tempfile::tempdir().unwrap();
        write_dump_images(images.path(), 1, &[]);
        if running {
            catch_running(images.path(), 1);
        }
        uses.at_stop(&host, &[1], images.path())
    }

    #[test]
    fn input_that_came_during_the_reclaim_is_a_use_and_input_left_from_before_is_not() {
        let (old, more) = (input(80, 7, 40, false), input(80, 7, 41, false));
        assert_eq!(why(vec![old.clone()], vec![old.clone()], false), None);
        assert_eq!(why(vec![old.clone()], vec![input(80, 7, 12, false)], false), None, "partly read");
        let unread = why(vec![old], vec![more], false).unwrap();
        assert_eq!(unread, "input waits to be taken: 41 bytes unread from 127.0.0.1:50000 on 127.0.0.1:80");
        let new = why(vec![], vec![input(80, 8, 5, false)], false).unwrap();
        assert!(new.contains("5 bytes unread"), "{new}");
        // A listener's waiting connections count whatever waited before.
        let listener = input(80, 9, 2, true);
        let waiting = why(vec![listener.clone()], vec![listener], false).unwrap();
        assert!(waiting.contains("2 connections waiting on 127.0.0.1:80"), "{waiting}");
    }

    #[test]
    fn a_thread_at_work_when_the_dump_stopped_it_is_a_use() {
        assert_eq!(why(vec![], vec![], false), None, "threads in system calls wait");
        let busy = why(vec![], vec![], true).unwrap();
        assert!(busy.contains("threads [1] were at work"), "{busy}");
    }

    #[test]
    fn a_dump_whose_threads_cannot_be_read_is_taken_as_idle() {
        let host = FakeHost::default();
        let empty = tempfile::tempdir().unwrap();
        assert_eq!(ReclaimUses::default().at_stop(&host, &[1], empty.path()), None);
    }

    #[test]
    fn a_use_seen_while_the_tree_ran_comes_first() {
        let uses = ReclaimUses::default();
        uses.seen.store(true, Ordering::SeqCst);
        let host = FakeHost::default();
        let reason = uses.at_stop(&host, &[1], Path::new("/nonexistent")).unwrap();
        assert_eq!(reason, "it was used during the reclaim");
    }
}
