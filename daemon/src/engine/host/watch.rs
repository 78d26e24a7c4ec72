//! What the idle monitor asks of the kernel (see `engine/idle/`): watches on a workload's
//! uses while it is reclaimed (and during its reclaim), and a hold on new connections while
//! it wakes. [`super::LinuxHost`] does it with a packet socket, sock_diag and nftables.

use std::io;
use std::net::SocketAddr;

use async_trait::async_trait;

use crate::linux::sock_diag::TcpSocketInfo;

/// The kernel's watches and holds, for idle workloads.
pub trait Watches: Send + Sync {
    /// A watch on the TCP segments that reach this network namespace for `ports`.
    fn watch_ports(&self, ports: &[u16]) -> io::Result<Box<dyn PortUses>>;
    /// A look at the TCP sockets of this network namespace.
    fn tcp_sockets(&self) -> io::Result<Box<dyn TcpSockets>>;
    /// Holds back new TCP connections to `ports` (their SYNs are dropped, so their peers send
    /// them again) until the hold is dropped; `name` tells the hold apart from others.
    fn hold_new_connections(&self, name: &str, ports: &[u16]) -> io::Result<Hold>;
}

/// A hold on new connections: dropped, it lets them in.
pub type Hold = Box<dyn Send + Sync>;

/// Segments seen for the ports a watch watches.
#[async_trait]
pub trait PortUses: Send + Sync {
    /// Waits for the next segment; returns the port it was for.
    async fn next(&self) -> io::Result<u16>;
}

/// The TCP sockets of this network namespace.
pub trait TcpSockets: Send {
    /// The socket whose ends are `local` and `remote`, if there is one.
    fn tcp(&mut self, local: SocketAddr, remote: SocketAddr) -> io::Result<Option<TcpSocketInfo>>;
}
