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
//! A request that came before the watch began is looked for once the dump has stopped the
//! tree (`in_use.rs`).

use std::net::SocketAddr;
use std::time::Duration;

use tracing::{debug, warn};

use crate::engine::host::{PortUses, TcpSockets, Watches};
use crate::linux::sock_diag::TCP_ESTABLISHED;

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
