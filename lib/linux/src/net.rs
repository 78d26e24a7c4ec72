//! Sockets as /proc shows them: the kernel's per-namespace socket tables
//! (`/proc/PID/net/{tcp,tcp6,udp,udp6,raw,raw6,unix,packet,netlink}`), keyed by socket inode;
//! the socket family of a descriptor that no table lists; and the few socket options stasisd
//! sets on a tree's sockets (through copies of their descriptors).

use std::collections::{HashMap, HashSet};
use std::fs;
use std::io;
use std::net::{IpAddr, Ipv4Addr, Ipv6Addr, SocketAddr, TcpStream};
use std::os::fd::AsFd;

use nix::sys::socket::{AddressFamily, getsockopt, setsockopt, sockopt};

/// The protocol of a socket, as far as the tables tell it.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum SocketKind {
    Tcp,
    Udp,
    Raw,
    Unix,
    Packet,
    Netlink,
}

impl SocketKind {
    const ALL: [SocketKind; 6] = [Self::Tcp, Self::Udp, Self::Raw, Self::Unix, Self::Packet, Self::Netlink];

    pub fn from_name(name: &str) -> Option<Self> {
        Self::ALL.into_iter().find(|k| k.name() == name)
    }

    pub fn name(self) -> &'static str {
        match self {
            Self::Tcp => "tcp",
            Self::Udp => "udp",
            Self::Raw => "raw",
            Self::Unix => "unix",
            Self::Packet => "packet",
            Self::Netlink => "netlink",
        }
    }
}

/// One row of a socket table.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct SocketEntry {
    pub kind: SocketKind,
    /// TCP state in the kernel's words ("established", "listen", ...); UDP: "connected" or
    /// "unconnected"; empty for other kinds.
    pub state: &'static str,
    pub local: Option<SocketAddr>,
    pub remote: Option<SocketAddr>,
    /// Unix sockets: the bound path ("@..." when abstract), if any.
    pub path: Option<String>,
    /// Unix sockets: listening.
    pub listening: bool,
    /// TCP and UDP: the receive queue, which for a TCP listener is the number of connections
    /// waiting to be accepted.
    pub queued: u32,
}

/// Every socket of one network namespace, by inode.
#[derive(Debug, Default)]
pub struct SocketTable {
    pub by_inode: HashMap<u64, SocketEntry>,
}

impl SocketTable {
    /// The sockets of the network namespace `pid` lives in (empty if it is gone).
    pub fn of(pid: i32) -> SocketTable {
        Self::read(&format!("/proc/{pid}/net"))
    }

    /// The sockets of stasisd's own network namespace.
    pub fn own() -> SocketTable {
        Self::read("/proc/self/net")
    }

    fn read(dir: &str) -> SocketTable {
        let mut table = SocketTable::default();
        let file = |name: &str| fs::read_to_string(format!("{dir}/{name}")).unwrap_or_default();
        for (name, kind) in [
            ("tcp", SocketKind::Tcp),
            ("tcp6", SocketKind::Tcp),
            ("udp", SocketKind::Udp),
            ("udp6", SocketKind::Udp),
            ("udplite", SocketKind::Udp),
            ("udplite6", SocketKind::Udp),
            ("raw", SocketKind::Raw),
            ("raw6", SocketKind::Raw),
        ] {
            table.by_inode.extend(parse_inet_table(&file(name), kind));
        }
        table.by_inode.extend(parse_unix_table(&file("unix")));
        table.by_inode.extend(parse_inode_column(&file("packet"), 8, SocketKind::Packet));
        table.by_inode.extend(parse_inode_column(&file("netlink"), 9, SocketKind::Netlink));
        table
    }

    /// Whether some TCP socket of this namespace has exactly these two ends.
    pub fn has_tcp(&self, local: SocketAddr, remote: SocketAddr) -> bool {
        self.by_inode
            .values()
            .any(|e| e.kind == SocketKind::Tcp && e.local == Some(local) && e.remote == Some(remote))
    }

    /// Sockets of `kind` bound to `port` on an address that overlaps `ip` (either one a
    /// wildcard, or both equal): TCP listeners, or bound UDP sockets.
    pub fn bound_on(&self, kind: SocketKind, ip: IpAddr, port: u16) -> Vec<u64> {
        self.by_inode
            .iter()
            .filter(|(_, e)| e.kind == kind && (kind != SocketKind::Tcp || e.state == "listen"))
            .filter(|(_, e)| e.local.is_some_and(|l| l.port() == port && overlaps(l.ip(), ip)))
            .map(|(inode, _)| *inode)
            .collect()
    }
}

/// Two bind addresses conflict when one is a wildcard or both are equal (IPv4-mapped
/// IPv6 addresses compare as IPv4).
fn overlaps(a: IpAddr, b: IpAddr) -> bool {
    let canonical = |ip: IpAddr| ip.to_canonical();
    a.is_unspecified() || b.is_unspecified() || canonical(a) == canonical(b)
}

/// Parses a `/proc/net/{tcp,udp,raw}[6]` table.
fn parse_inet_table(text: &str, kind: SocketKind) -> Vec<(u64, SocketEntry)> {
    text.lines()
        .skip(1)
        .filter_map(|line| {
            let cols: Vec<&str> = line.split_whitespace().collect();
            let local = parse_hex_addr(cols.get(1)?)?;
            let remote = parse_hex_addr(cols.get(2)?)?;
            let state = u8::from_str_radix(cols.get(3)?, 16).ok()?;
            let queued = cols.get(4)?.split_once(':').and_then(|(_, rx)| u32::from_str_radix(rx, 16).ok())?;
            let inode: u64 = cols.get(9)?.parse().ok()?;
            let state = match kind {
                SocketKind::Tcp => tcp_state_name(state),
                SocketKind::Udp if state == 1 => "connected",
                SocketKind::Udp => "unconnected",
                _ => "",
            };
            let remote = (!remote.ip().is_unspecified() || remote.port() != 0).then_some(remote);
            let entry =
                SocketEntry { kind, state, local: Some(local), remote, path: None, listening: false, queued };
            Some((inode, entry))
        })
        .collect()
}

/// The kernel's TCP states (include/net/tcp_states.h), lower-cased.
fn tcp_state_name(state: u8) -> &'static str {
    match state {
        1 => "established",
        2 => "syn-sent",
        3 => "syn-recv",
        4 => "fin-wait1",
        5 => "fin-wait2",
        6 => "time-wait",
        7 => "close",
        8 => "close-wait",
        9 => "last-ack",
        10 => "listen",
        11 => "closing",
        _ => "unknown",
    }
}

/// Parses `0100007F:1F90` (IPv4, the address's bytes as a host-order word) or the 32-digit
/// IPv6 form (four such words). IPv4-mapped IPv6 addresses (a dual-stack socket talking IPv4)
/// come out as IPv4, so both ends of a connection compare equal whatever their family.
fn parse_hex_addr(text: &str) -> Option<SocketAddr> {
    let (addr, port) = text.split_once(':')?;
    let port = u16::from_str_radix(port, 16).ok()?;
    let word = |s: &str| u32::from_str_radix(s, 16).ok().map(u32::to_ne_bytes);
    let ip = match addr.len() {
        8 => IpAddr::V4(Ipv4Addr::from(word(addr)?)),
        32 => {
            let mut bytes = [0u8; 16];
            for (i, chunk) in bytes.chunks_mut(4).enumerate() {
                chunk.copy_from_slice(&word(addr.get(i * 8..i * 8 + 8)?)?);
            }
            IpAddr::V6(Ipv6Addr::from(bytes)).to_canonical()
        }
        _ => return None,
    };
    Some(SocketAddr::new(ip, port))
}

/// `__SO_ACCEPTCON` in `/proc/net/unix`'s flags column: a listening socket.
const UNIX_ACCEPTCON: u32 = 1 << 16;

/// Parses `/proc/net/unix`: `Num RefCount Protocol Flags Type St Inode [Path]`.
fn parse_unix_table(text: &str) -> Vec<(u64, SocketEntry)> {
    text.lines()
        .skip(1)
        .filter_map(|line| {
            let cols: Vec<&str> = line.split_whitespace().collect();
            let flags = u32::from_str_radix(cols.get(3)?, 16).ok()?;
            let inode: u64 = cols.get(6)?.parse().ok()?;
            let entry = SocketEntry {
                kind: SocketKind::Unix,
                state: "",
                local: None,
                remote: None,
                path: cols.get(7).map(|p| p.to_string()),
                listening: flags & UNIX_ACCEPTCON != 0,
                queued: 0,
            };
            Some((inode, entry))
        })
        .collect()
}

/// Parses a table whose rows only matter by their inode column.
fn parse_inode_column(text: &str, column: usize, kind: SocketKind) -> Vec<(u64, SocketEntry)> {
    text.lines()
        .skip(1)
        .filter_map(|line| line.split_whitespace().nth(column)?.parse().ok())
        .map(|inode| {
            let entry = SocketEntry {
                kind,
                state: "",
                local: None,
                remote: None,
                path: None,
                listening: false,
                queued: 0,
            };
            (inode, entry)
        })
        .collect()
}

/// The address family (`AF_*`) of descriptor `fd` of process `pid`.
pub fn socket_family(pid: i32, fd: i32) -> io::Result<i32> {
    let copy = super::sys::copy_fd_of(pid, fd)?;
    super::sys::socket_domain(copy.as_fd())
}

/// "AF_VSOCK" for `libc::AF_VSOCK`, and so on.
pub fn family_name(domain: i32) -> String {
    match AddressFamily::from_i32(domain) {
        Some(family) => format!("AF_{}", format!("{family:?}").to_uppercase()),
        None => format!("address family {domain}"),
    }
}

/// Whether TCP socket `fd` of `pid` has `SO_REUSEADDR` set.
pub fn reuse_addr(pid: i32, fd: i32) -> io::Result<bool> {
    let copy = super::sys::copy_fd_of(pid, fd)?;
    Ok(getsockopt(&copy, sockopt::ReuseAddr)?)
}

/// Takes socket `fd` of `pid` out of TCP repair mode if it is in it, and sets `SO_REUSEADDR` to
/// `reuse_addr` again (leaving repair mode clears it). Returns the connection's two ends if it
/// was in repair mode, `None` if it was not (or is no TCP socket).
pub fn leave_repair(pid: i32, fd: i32, reuse_addr: bool) -> io::Result<Option<(SocketAddr, SocketAddr)>> {
    let copy = super::sys::copy_fd_of(pid, fd)?;
    match getsockopt(&copy, sockopt::TcpRepair) {
        Ok(0) | Err(_) => return Ok(None),
        Ok(_) => {}
    }
    setsockopt(&copy, sockopt::TcpRepair, &0)?;
    setsockopt(&copy, sockopt::ReuseAddr, &reuse_addr)?;
    // Only to read its addresses; dropping it closes our copy, not the tree's socket.
    let stream = TcpStream::from(copy);
    Ok(Some((stream.local_addr()?, stream.peer_addr()?)))
}

/// The processes (pid, command name) holding socket `inode` open, found by scanning /proc.
pub fn socket_holders(inode: u64) -> Vec<(i32, String)> {
    let wanted = format!("socket:[{inode}]");
    super::proc::all_pids()
        .into_iter()
        .filter(|pid| {
            super::proc::fd_targets(*pid)
                .is_ok_and(|fds| fds.iter().any(|(_, t)| t.as_os_str() == wanted.as_str()))
        })
        .map(|pid| {
            let comm = fs::read_to_string(format!("/proc/{pid}/comm")).unwrap_or_default();
            (pid, comm.trim().to_string())
        })
        .collect()
}

/// The network namespace of `pid` (the inode of `/proc/PID/ns/net`).
pub fn netns_of(pid: i32) -> io::Result<u64> {
    use std::os::unix::fs::MetadataExt;
    Ok(fs::metadata(format!("/proc/{pid}/ns/net"))?.ino())
}

/// stasisd's own network namespace.
pub fn own_netns() -> io::Result<u64> {
    use std::os::unix::fs::MetadataExt;
    Ok(fs::metadata("/proc/self/ns/net")?.ino())
}

/// Input that a TCP socket of a process tree holds and the tree has not taken.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct WaitingInput {
    pub inode: u64,
    pub local: SocketAddr,
    /// The peer of a connection; `None` for a listener.
    pub remote: Option<SocketAddr>,
    /// A listener: connections waiting to be accepted. A connection: bytes received and not
    /// yet read.
    pub queued: u32,
}

/// The TCP sockets of processes `pids` that hold input: listeners with connections waiting
/// to be accepted, and connections with bytes not yet read whose peer is not one of `pids`'
/// sockets (a client that connected or wrote before the tree stopped, which an eviction would
/// leave unanswered).
pub fn waiting_input(pids: &[i32]) -> Vec<WaitingInput> {
    let mut tables: HashMap<u64, SocketTable> = HashMap::new();
    let mut held: HashSet<(u64, u64)> = HashSet::new();
    for &pid in pids {
        let (Ok(netns), Ok(fds)) = (netns_of(pid), super::proc::fd_targets(pid)) else { continue };
        tables.entry(netns).or_insert_with(|| SocketTable::of(pid));
        held.extend(fds.iter().filter_map(|(_, target)| Some((netns, socket_inode(target)?))));
    }
    let tcp = |netns: &u64, inode: &u64| {
        tables.get(netns)?.by_inode.get(inode).filter(|e| e.kind == SocketKind::Tcp)
    };
    // The ends of the tree's connections: (netns, local, remote) of each.
    let ends: HashSet<_> = held
        .iter()
        .filter_map(|(netns, inode)| tcp(netns, inode).map(|e| (*netns, e.local, e.remote)))
        .collect();
    held.iter()
        .filter_map(|(netns, inode)| {
            let e = tcp(netns, inode).filter(|e| e.queued > 0)?;
            let local = e.local?;
            let inside = e.remote.is_some_and(|_| ends.contains(&(*netns, e.remote, e.local)));
            let taken_in = (e.state == "listen") == e.remote.is_none();
            (taken_in && !inside).then_some(WaitingInput {
                inode: *inode,
                local,
                remote: e.remote,
                queued: e.queued,
            })
        })
        .collect()
}

/// The inode of a `socket:[N]` link target.
pub fn socket_inode(target: &std::path::Path) -> Option<u64> {
    target.to_str()?.strip_prefix("socket:[")?.strip_suffix(']')?.parse().ok()
}

#[cfg(test)]
mod tests {
    use super::*;

    const TCP: &str = "  sl  local_address rem_address   st tx_queue rx_queue tr tm->when retrnsmt   uid  timeout inode
   0: 0100007F:1F90 00000000:0000 0A 00000000:00000000 00:00000000 00000000     0        0 1111 1 0 100 0 0 10 0
   1: 0100007F:9C40 0100007F:1F90 01 00000000:00000000 00:00000000 00000000     0        0 2222 1 0 20 4 30 10 -1
";
    const TCP6: &str = "  sl  local_address                         remote_address                        st tx_queue rx_queue tr tm->when retrnsmt   uid  timeout inode
   0: 00000000000000000000000001000000:0035 00000000000000000000000000000000:0000 0A 00000000:00000000 00:00000000 00000000     0        0 3333 1 0 100 0 0 10 0
";

    /// What `look` finds, looked at again until `until` holds of it (at most a second: the
    /// kernel queues asynchronously).
    fn polled<T>(look: impl Fn() -> T, until: impl Fn(&T) -> bool) -> T {
        for _ in 0..99 {
            let found = look();
            if until(&found) {
                return found;
            }
            std::thread::sleep(std::time::Duration::from_millis(10));
        }
        look()
    }

    /// What of `waiting_input(pids)` concerns local address `addr`, polled until `until`
    /// holds of it.
    fn waiting_at(
        pids: &[i32],
        addr: SocketAddr,
        until: impl Fn(&[WaitingInput]) -> bool,
    ) -> Vec<WaitingInput> {
        let look = || waiting_input(pids).into_iter().filter(|w| w.local == addr).collect::<Vec<_>>();
        polled(look, |found| until(found))
    }

    #[test]
    fn a_listener_with_a_connection_not_yet_accepted_holds_input_until_it_is_accepted() {
        let listener = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
        let addr = listener.local_addr().unwrap();
        let me = [std::process::id() as i32];
        assert!(waiting_at(&me, addr, |_| true).is_empty(), "nothing waits yet");
        let _client = std::net::TcpStream::connect(addr).unwrap();
        let waiting = waiting_at(&me, addr, |w| !w.is_empty());
        assert_eq!(
            waiting.iter().map(|w| (w.remote, w.queued)).collect::<Vec<_>>(),
            [(None, 1)],
            "the connection waits in {addr}'s accept queue"
        );
        let _accepted = listener.accept().unwrap();
        assert!(waiting_at(&me, addr, |w| w.is_empty()).is_empty(), "accepted, nothing waits");
    }

    #[test]
    fn bytes_unread_from_a_peer_outside_the_tree_are_input_and_from_one_inside_are_not() {
        use std::io::{Read, Write};
        let listener = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
        let addr = listener.local_addr().unwrap();
        let me = [std::process::id() as i32];
        // A peer in another process writes 6 bytes and waits.
        let mut peer = std::process::Command::new("bash")
            .args(["-c", &format!("exec 3<>/dev/tcp/127.0.0.1/{}; printf hello. >&3; sleep 30", addr.port())])
            .spawn()
            .unwrap();
        let (mut outside, remote) = listener.accept().unwrap();
        let waiting = waiting_at(&me, addr, |w| !w.is_empty());
        assert_eq!(waiting.iter().map(|w| (w.remote, w.queued)).collect::<Vec<_>>(), [(Some(remote), 6)]);
        let mut read = [0u8; 6];
        outside.read_exact(&mut read).unwrap();
        // Looked at before the peer goes: its close would queue an end of stream.
        let left = waiting_at(&me, addr, |w| w.is_empty());
        peer.kill().unwrap();
        peer.wait().unwrap();
        assert!(left.is_empty(), "read, nothing waits: {left:?}");

        // Both ends here: bytes between two sockets of the tree are no request from outside.
        let mut inside = std::net::TcpStream::connect(addr).unwrap();
        let (accepted, _) = listener.accept().unwrap();
        inside.write_all(b"internal").unwrap();
        let link =
            fs::read_link(format!("/proc/self/fd/{}", std::os::fd::AsRawFd::as_raw_fd(&accepted))).unwrap();
        let accepted_inode = socket_inode(&link).unwrap();
        let queued =
            polled(|| SocketTable::own().by_inode.get(&accepted_inode).map(|e| e.queued), |q| *q == Some(8));
        assert_eq!(queued, Some(8), "the 8 bytes wait in the accepted socket");
        let waiting = waiting_input(&me);
        assert!(waiting.iter().all(|w| w.inode != accepted_inode), "{waiting:?}");
    }

    #[test]
    fn inet_rows_give_addresses_and_states() {
        let rows: HashMap<u64, SocketEntry> = parse_inet_table(TCP, SocketKind::Tcp).into_iter().collect();
        let listener = &rows[&1111];
        assert_eq!(listener.state, "listen");
        assert_eq!(listener.local, Some("127.0.0.1:8080".parse().unwrap()));
        assert_eq!(listener.remote, None);
        let conn = &rows[&2222];
        assert_eq!(conn.state, "established");
        assert_eq!(conn.remote, Some("127.0.0.1:8080".parse().unwrap()));
        assert_eq!(conn.local, Some("127.0.0.1:40000".parse().unwrap()));
        let six = parse_inet_table(TCP6, SocketKind::Tcp);
        assert_eq!(six[0].1.local, Some("[::1]:53".parse().unwrap()));
        // ::ffff:127.0.0.1 port 8080, as a dual-stack listener's accepted connection shows it.
        let mapped = parse_hex_addr("0000000000000000FFFF00000100007F:1F90").unwrap();
        assert_eq!(mapped, "127.0.0.1:8080".parse().unwrap());
        assert_eq!(SocketKind::from_name("udp"), Some(SocketKind::Udp));
        assert_eq!(SocketKind::from_name("sctp"), None);
    }

    #[test]
    fn socket_links() {
        assert_eq!(socket_inode(std::path::Path::new("socket:[12345]")), Some(12345));
        assert_eq!(socket_inode(std::path::Path::new("/dev/null")), None);
        assert_eq!(socket_inode(std::path::Path::new("pipe:[7]")), None);
    }

    #[test]
    fn listeners_conflict_by_port_and_overlapping_address() {
        let table = SocketTable { by_inode: parse_inet_table(TCP, SocketKind::Tcp).into_iter().collect() };
        let lo: IpAddr = "127.0.0.1".parse().unwrap();
        assert_eq!(table.bound_on(SocketKind::Tcp, lo, 8080), vec![1111]);
        assert_eq!(table.bound_on(SocketKind::Tcp, "0.0.0.0".parse().unwrap(), 8080), vec![1111]);
        assert!(table.bound_on(SocketKind::Tcp, "10.1.2.3".parse().unwrap(), 8080).is_empty());
        // An established connection from port 40000 is not a listener on it.
        assert!(table.bound_on(SocketKind::Tcp, lo, 40000).is_empty());
        assert!(table.has_tcp("127.0.0.1:40000".parse().unwrap(), "127.0.0.1:8080".parse().unwrap()));
    }

    #[test]
    fn unix_rows_say_listening_and_path() {
        let text = "Num       RefCount Protocol Flags    Type St Inode Path
0000000000000000: 00000002 00000000 00010000 0001 01 4444 /run/x.sock
0000000000000000: 00000003 00000000 00000000 0001 03 5555
";
        let rows: HashMap<u64, SocketEntry> = parse_unix_table(text).into_iter().collect();
        assert!(rows[&4444].listening);
        assert_eq!(rows[&4444].path.as_deref(), Some("/run/x.sock"));
        assert!(!rows[&5555].listening);
    }

    #[test]
    fn own_table_sees_a_listener_of_ours() {
        let listener = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
        let addr = listener.local_addr().unwrap();
        let table = SocketTable::own();
        assert_eq!(table.bound_on(SocketKind::Tcp, addr.ip(), addr.port()).len(), 1);
    }
}
