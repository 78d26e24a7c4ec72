//! One TCP socket of this network namespace, looked up by its addresses over NETLINK_SOCK_DIAG:
//! its state and how many bytes it has written that the other end has not acknowledged.
//!
//! A request is `SOCK_DIAG_BY_FAMILY` with a `struct inet_diag_req_v2` naming the socket
//! exactly (its local address and port as the id's source, its remote ones as destination,
//! no cookie); the kernel answers with one `struct inet_diag_msg`, or an NLMSG_ERROR with
//! ENOENT when no such socket exists.

use std::io;
use std::net::{IpAddr, SocketAddr};
use std::os::fd::{AsRawFd, OwnedFd};
use std::time::Duration;

use nix::sys::socket::{
    AddressFamily, MsgFlags, NetlinkAddr, SockFlag, SockProtocol, SockType, recv, sendto, setsockopt, socket,
    sockopt,
};
use nix::sys::time::TimeVal;

use super::netlink::{self, NLM_F_REQUEST};

const SOCK_DIAG_BY_FAMILY: u16 = 20;
/// `INET_DIAG_NOCOOKIE`: look the socket up by its addresses alone.
const NO_COOKIE: u32 = !0;
/// The kernel answers at once; this only bounds a surprise.
const ANSWER_TIMEOUT: Duration = Duration::from_secs(1);
/// `struct inet_diag_msg` up to and including `idiag_wqueue`.
const MSG_WQUEUE_END: usize = 4 + 48 + 12;

/// TCP states, as `include/net/tcp_states.h` numbers them.
pub const TCP_ESTABLISHED: u8 = 1;

/// What the kernel says of one TCP socket.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct TcpSocketInfo {
    /// TCP state ([`TCP_ESTABLISHED`], ...).
    pub state: u8,
    /// Bytes written and not yet acknowledged by the other end (sent or still queued).
    pub unacked: u32,
}

/// A NETLINK_SOCK_DIAG socket.
pub struct SockDiag {
    socket: OwnedFd,
    seq: u32,
}

impl SockDiag {
    pub fn open() -> io::Result<SockDiag> {
        let socket = socket(
            AddressFamily::Netlink,
            SockType::Raw,
            SockFlag::SOCK_CLOEXEC,
            SockProtocol::NetlinkSockDiag,
        )?;
        setsockopt(&socket, sockopt::ReceiveTimeout, &TimeVal::new(ANSWER_TIMEOUT.as_secs() as _, 0))?;
        Ok(SockDiag { socket, seq: 0 })
    }

    /// The TCP socket of this network namespace bound to `local` and connected to `remote`;
    /// `None` when there is none (the connection's end is on another node, or in another
    /// network namespace, or gone).
    pub fn tcp(&mut self, local: SocketAddr, remote: SocketAddr) -> io::Result<Option<TcpSocketInfo>> {
        self.seq = self.seq.wrapping_add(1);
        let mut request = Vec::new();
        netlink::message(
            &mut request,
            SOCK_DIAG_BY_FAMILY,
            NLM_F_REQUEST,
            self.seq,
            &request_body(local, remote),
        );
        sendto(self.socket.as_raw_fd(), &request, &NetlinkAddr::new(0, 0), MsgFlags::empty())?;
        let mut buf = [0u8; 1024];
        loop {
            // A timeout ends this with EAGAIN.
            let n = recv(self.socket.as_raw_fd(), &mut buf, MsgFlags::empty())?;
            if let Some(answer) = answer(&buf[..n], self.seq)? {
                return answer;
            }
        }
    }
}

/// `struct inet_diag_req_v2` naming the socket at `local` connected to `remote`.
fn request_body(local: SocketAddr, remote: SocketAddr) -> Vec<u8> {
    let family = if local.is_ipv4() && remote.is_ipv4() { libc::AF_INET } else { libc::AF_INET6 };
    let mut body = vec![family as u8, libc::IPPROTO_TCP as u8, 0, 0];
    body.extend_from_slice(&u32::MAX.to_ne_bytes()); // every state
    body.extend_from_slice(&local.port().to_be_bytes());
    body.extend_from_slice(&remote.port().to_be_bytes());
    body.extend_from_slice(&address(local.ip(), family));
    body.extend_from_slice(&address(remote.ip(), family));
    body.extend_from_slice(&0u32.to_ne_bytes()); // any interface
    body.extend_from_slice(&NO_COOKIE.to_ne_bytes());
    body.extend_from_slice(&NO_COOKIE.to_ne_bytes());
    body
}

/// `ip` as the 16 bytes of an inet_diag address: IPv4 in the first four for AF_INET, as an
/// IPv4-mapped IPv6 address for AF_INET6.
fn address(ip: IpAddr, family: i32) -> [u8; 16] {
    let mut out = [0u8; 16];
    match ip {
        IpAddr::V4(v4) if family == libc::AF_INET => out[..4].copy_from_slice(&v4.octets()),
        IpAddr::V4(v4) => out = v4.to_ipv6_mapped().octets(),
        IpAddr::V6(v6) => out = v6.octets(),
    }
    out
}

/// The socket an answer to request `seq` describes: `Some(Ok(None))` for ENOENT, `None` when
/// `buf` holds no answer to it.
fn answer(buf: &[u8], seq: u32) -> io::Result<Option<io::Result<Option<TcpSocketInfo>>>> {
    for m in netlink::messages(buf)?.into_iter().filter(|m| m.seq == seq) {
        match m.errno()? {
            Some(libc::ENOENT) => return Ok(Some(Ok(None))),
            Some(errno) => return Ok(Some(Err(io::Error::from_raw_os_error(errno)))),
            None if m.kind == SOCK_DIAG_BY_FAMILY && m.body.len() >= MSG_WQUEUE_END => {
                let unacked = u32::from_ne_bytes(
                    m.body[MSG_WQUEUE_END - 4..MSG_WQUEUE_END].try_into().unwrap_or_default(),
                );
                return Ok(Some(Ok(Some(TcpSocketInfo { state: m.body[1], unacked }))));
            }
            None => {}
        }
    }
    Ok(None)
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::io::Write;
    use std::net::{TcpListener, TcpStream};

    #[test]
    fn request_layout() {
        let body = request_body("127.0.0.1:5000".parse().unwrap(), "10.1.2.3:80".parse().unwrap());
        assert_eq!(body.len(), 56, "inet_diag_req_v2");
        assert_eq!(body[0], libc::AF_INET as u8);
        assert_eq!(&body[8..12], &[0x13, 0x88, 0, 80]);
        assert_eq!(&body[12..16], &[127, 0, 0, 1]);
        assert_eq!(&body[28..32], &[10, 1, 2, 3]);
        let mapped =
            request_body("[::ffff:127.0.0.1]:5000".parse().unwrap(), "127.0.0.1:80".parse().unwrap());
        assert_eq!(mapped[0], libc::AF_INET6 as u8);
        assert_eq!(&mapped[28..44], &"::ffff:127.0.0.1".parse::<std::net::Ipv6Addr>().unwrap().octets());
    }

    #[test]
    fn finds_a_connection_and_sees_unacknowledged_bytes() {
        let listener = TcpListener::bind("127.0.0.1:0").unwrap();
        let server_addr = listener.local_addr().unwrap();
        let mut client = TcpStream::connect(server_addr).unwrap();
        let (server, _) = listener.accept().unwrap();
        let client_addr = client.local_addr().unwrap();
        let mut diag = SockDiag::open().unwrap();
        let seen = diag.tcp(client_addr, server_addr).unwrap().expect("the client's socket");
        assert_eq!(seen, TcpSocketInfo { state: TCP_ESTABLISHED, unacked: 0 });
        // The other way round is the server's socket; a port nobody uses is no socket.
        assert!(diag.tcp(server_addr, client_addr).unwrap().is_some());
        assert_eq!(diag.tcp(client_addr, "127.0.0.1:1".parse().unwrap()).unwrap(), None);
        // Bytes the server acknowledges leave the count; with the server gone, the client's
        // close is a state change.
        client.write_all(b"hello").unwrap();
        let settled = (0..100).find_map(|_| {
            std::thread::sleep(Duration::from_millis(10));
            diag.tcp(client_addr, server_addr).unwrap().filter(|s| s.unacked == 0)
        });
        assert!(settled.is_some(), "the server's kernel acknowledges at once");
        drop(server);
        drop(client);
        let after = diag.tcp(client_addr, server_addr).unwrap();
        assert!(after.is_none_or(|s| s.state != TCP_ESTABLISHED), "{after:?}");
    }
}
