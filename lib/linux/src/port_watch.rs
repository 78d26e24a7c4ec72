//! Noticing TCP traffic to local ports that no live socket may own: the ports of a reclaimed
//! workload, whose connections CRIU's lock drops and whose listeners are gone.
//!
//! A packet socket sees every packet the node receives before netfilter (and so CRIU's lock)
//! drops it. (Not those a process of this network namespace sends: the lock drops them in
//! the output hook, before they reach the loopback interface.) A classic BPF filter keeps only TCP segments to the watched ports, so the
//! rest of the node's traffic never reaches stasisd; what it lets through is parsed here, and
//! only segments that carry data, open a connection or close one count: a peer's bare ACKs
//! and keepalive probes of an idle connection do not.

use std::io;
use std::os::fd::{AsFd, AsRawFd, OwnedFd};

use nix::sys::socket::{AddressFamily, MsgFlags, SockFlag, SockProtocol, SockType, recv, socket};
use tokio::io::unix::AsyncFd;

use super::sys::{async_fd, attach_filter};

/// At most this many ports per watch (the filter's jumps are 8 bits wide).
pub const MAX_PORTS: usize = 100;

/// Bytes of each packet the filter hands over: the IP and TCP headers.
const SNAP: u32 = 128;

/// A watch on TCP segments sent to some local ports.
pub struct PortWatch {
    socket: AsyncFd<OwnedFd>,
}

impl PortWatch {
    /// Starts watching `ports` (on every interface, IPv4 and IPv6). Needs CAP_NET_RAW.
    pub fn open(ports: &[u16]) -> io::Result<PortWatch> {
        if ports.is_empty() || ports.len() > MAX_PORTS {
            return Err(io::Error::other(format!("cannot watch {} ports (1 to {MAX_PORTS})", ports.len())));
        }
        let fd = socket(
            AddressFamily::Packet,
            SockType::Datagram,
            SockFlag::SOCK_NONBLOCK | SockFlag::SOCK_CLOEXEC,
            SockProtocol::EthAll,
        )?;
        attach_filter(fd.as_fd(), &filter(ports))?;
        // Packets queued before the filter was attached are not for us.
        let mut buf = [0u8; SNAP as usize];
        while recv(fd.as_raw_fd(), &mut buf, MsgFlags::MSG_DONTWAIT).is_ok() {}
        Ok(PortWatch { socket: async_fd(fd)? })
    }

    /// Waits for the next segment to a watched port that carries data, opens a connection or
    /// closes one; returns its destination port.
    pub async fn next(&self) -> io::Result<u16> {
        let mut buf = [0u8; SNAP as usize];
        loop {
            let mut ready = self.socket.readable().await?;
            match ready
                .try_io(|fd| recv(fd.as_raw_fd(), &mut buf, MsgFlags::MSG_TRUNC).map_err(io::Error::from))
            {
                Ok(Ok(len)) => {
                    if let Some(port) = significant(&buf[..len.min(buf.len())]) {
                        return Ok(port);
                    }
                }
                Ok(Err(e)) => return Err(e),
                Err(_would_block) => continue,
            }
        }
    }
}

/// The classic BPF program: accept (the first [`SNAP`] bytes of) unfragmented TCP over IPv4 or
/// IPv6 (without extension headers) whose destination port is one of `ports`.
fn filter(ports: &[u16]) -> Vec<libc::sock_filter> {
    let op = |code: u32, jt: u8, jf: u8, k: u32| libc::sock_filter { code: code as u16, jt, jf, k };
    let (ld_h_abs, ld_b_abs, ld_h_ind) = (
        libc::BPF_LD | libc::BPF_H | libc::BPF_ABS,
        libc::BPF_LD | libc::BPF_B | libc::BPF_ABS,
        libc::BPF_LD | libc::BPF_H | libc::BPF_IND,
    );
    let jeq = libc::BPF_JMP | libc::BPF_JEQ | libc::BPF_K;
    let ret = libc::BPF_RET | libc::BPF_K;
    let n = ports.len() as u8;
    // Port comparisons: each jumps to "accept" (n - i instructions ahead) on a match, the last
    // falls through to "drop".
    let compare = |prog: &mut Vec<libc::sock_filter>| {
        for (i, &port) in ports.iter().enumerate() {
            prog.push(op(jeq, n - i as u8, 0, u32::from(port)));
        }
        prog.push(op(ret, 0, 0, 0));
        prog.push(op(ret, 0, 0, SNAP));
    };
    // IPv4 block: 7 instructions, then the comparisons.
    let v4_len = 7 + n + 2;
    let mut prog = vec![
        // The link layer's protocol (ethertype) of the packet.
        op(ld_h_abs, 0, 0, (libc::SKF_AD_OFF + libc::SKF_AD_PROTOCOL) as u32),
        op(jeq, 0, v4_len, libc::ETH_P_IP as u32),
        op(ld_b_abs, 0, 0, 9), // IPv4 protocol
        op(jeq, 1, 0, libc::IPPROTO_TCP as u32),
        op(ret, 0, 0, 0),
        op(ld_h_abs, 0, 0, 6), // flags and fragment offset
        op(libc::BPF_JMP | libc::BPF_JSET | libc::BPF_K, n + 3, 0, 0x1fff),
        op(libc::BPF_LDX | libc::BPF_B | libc::BPF_MSH, 0, 0, 0), // X = header length
        op(ld_h_ind, 0, 0, 2),                                    // TCP destination port
    ];
    compare(&mut prog);
    // IPv6 block.
    prog.extend([
        op(jeq, 0, 3 + n + 1, libc::ETH_P_IPV6 as u32),
        op(ld_b_abs, 0, 0, 6), // next header
        op(jeq, 0, n + 2, libc::IPPROTO_TCP as u32),
        op(ld_h_abs, 0, 0, 42), // 40-byte header, then the TCP destination port
    ]);
    compare(&mut prog);
    prog
}

/// The destination port of a TCP segment (IP header first) that carries data, or has SYN
/// (without ACK) or FIN set.
fn significant(packet: &[u8]) -> Option<u16> {
    let (ip_len, payload_total) = match packet.first()? >> 4 {
        4 => {
            let ihl = usize::from(packet[0] & 0x0f) * 4;
            let total = usize::from(u16::from_be_bytes([*packet.get(2)?, *packet.get(3)?]));
            (ihl, total.checked_sub(ihl)?)
        }
        6 => (40, usize::from(u16::from_be_bytes([*packet.get(4)?, *packet.get(5)?]))),
        _ => return None,
    };
    let tcp = packet.get(ip_len..)?;
    let port = u16::from_be_bytes([*tcp.get(2)?, *tcp.get(3)?]);
    let data_offset = usize::from(tcp.get(12)? >> 4) * 4;
    let flags = *tcp.get(13)?;
    let (fin, syn, ack) = (flags & 0x01 != 0, flags & 0x02 != 0, flags & 0x10 != 0);
    let carries_data = payload_total > data_offset;
    (carries_data || fin || (syn && !ack)).then_some(port)
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::io::Write;
    use std::net::{TcpListener, TcpStream};
    use std::time::Duration;

    /// An IPv4 TCP segment to `port` with `flags` and `data` bytes of payload.
    fn v4(port: u16, flags: u8, data: usize) -> Vec<u8> {
        let total = (20 + 20 + data) as u16;
        let mut p = vec![
            0x45,
            0,
            (total >> 8) as u8,
            total as u8,
            0,
            0,
            0x40,
            0,
            64,
            6,
            0,
            0,
            127,
            0,
            0,
            1,
            127,
            0,
            0,
            1,
        ];
        p.extend([
            0x9c,
            0x40,
            (port >> 8) as u8,
            port as u8,
            0,
            0,
            0,
            0,
            0,
            0,
            0,
            0,
            0x50,
            flags,
            0,
            0,
            0,
            0,
            0,
            0,
        ]);
        p.resize(p.len() + data, 0xab);
        p
    }

    #[test]
    fn only_data_opening_and_closing_count() {
        assert_eq!(significant(&v4(8080, 0x18, 100)), Some(8080), "data");
        assert_eq!(significant(&v4(8080, 0x02, 0)), Some(8080), "SYN");
        assert_eq!(significant(&v4(8080, 0x11, 0)), Some(8080), "FIN");
        assert_eq!(significant(&v4(8080, 0x10, 0)), None, "a bare ACK");
        assert_eq!(significant(&v4(8080, 0x12, 0)), None, "a SYN-ACK answers, it does not open");
        assert_eq!(significant(&v4(8080, 0x04, 0)), None, "RST");
        assert_eq!(significant(&v4(8080, 0x18, 0)[..30]), None, "cut short");
        assert_eq!(significant(&[]), None);
    }

    #[test]
    fn the_filter_jumps_land_on_returns() {
        for n in [1usize, 2, 7, MAX_PORTS] {
            let ports: Vec<u16> = (0..n as u16).map(|p| 1000 + p).collect();
            let prog = filter(&ports);
            for (i, ins) in prog.iter().enumerate() {
                if u32::from(ins.code) & 0x07 == libc::BPF_JMP {
                    for target in [i + 1 + usize::from(ins.jt), i + 1 + usize::from(ins.jf)] {
                        assert!(target < prog.len(), "instruction {i} jumps out of the program");
                    }
                }
            }
            assert_eq!(u32::from(prog.last().unwrap().code), libc::BPF_RET | libc::BPF_K);
        }
    }

    #[tokio::test]
    async fn sees_a_connection_and_data_to_a_watched_port_only() {
        if !nix::unistd::geteuid().is_root() {
            eprintln!("skipping: packet sockets need CAP_NET_RAW");
            return;
        }
        let (watched, other) =
            (TcpListener::bind("127.0.0.1:0").unwrap(), TcpListener::bind("127.0.0.1:0").unwrap());
        let port = watched.local_addr().unwrap().port();
        let watch = PortWatch::open(&[port]).unwrap();
        // Traffic to another port is filtered out in the kernel.
        let mut elsewhere = TcpStream::connect(other.local_addr().unwrap()).unwrap();
        elsewhere.write_all(b"not for the watch").unwrap();
        let quiet = tokio::time::timeout(Duration::from_millis(300), watch.next()).await;
        assert!(quiet.is_err(), "nothing to the watched port yet: {quiet:?}");
        let _conn = TcpStream::connect(("127.0.0.1", port)).unwrap();
        let seen = tokio::time::timeout(Duration::from_secs(5), watch.next()).await;
        assert_eq!(seen.expect("a SYN to the watched port").unwrap(), port);
    }
}
