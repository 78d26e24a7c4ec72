//! The sockets of a tree, from its dump to its restore.
//!
//! ```text
//! checkpoint: survey every socket descriptor -> refuse, before anything is frozen, kinds
//!   CRIU cannot dump (and network sockets when this CRIU cannot dump them on this kernel)
//!   -> record them in the manifest
//! eviction whose storing failed: take the tree's connections out of CRIU's repair mode
//!   (leave_repair, here) and remove CRIU's lock, so the resumed tree talks again (rollback.rs)
//! restore: a listener's port taken, or a local address missing -> refuse before CRIU runs;
//!   a loopback peer gone -> warn (the tree will find that connection reset)   (restore_check.rs)
//! an eviction never restored here: its lock removed after a while           (left_locks.rs)
//! ```

mod left_locks;
mod restore_check;
mod rollback;

use std::collections::{HashMap, HashSet};

pub use left_locks::{LeftLocks, SWEEP_EVERY};
pub use restore_check::check_restore;
pub use rollback::{Connection, unlock};
use stasis_proto::stasis::store::v1::SocketRecord;
use tracing::{debug, info};

use crate::criu::NetworkLock;
use crate::linux::net::{self, SocketKind, SocketTable};
use crate::linux::proc::{self, ProcStat};

/// Families CRIU dumps; a socket of another family is refused up front.
const DUMPABLE_FAMILIES: [i32; 5] =
    [libc::AF_UNIX, libc::AF_INET, libc::AF_INET6, libc::AF_PACKET, libc::AF_NETLINK];

/// What a survey of a tree's descriptors found.
#[derive(Debug, Clone, Default)]
pub struct TreeSockets {
    pub records: Vec<SocketRecord>,
    /// Sockets CRIU cannot dump, described for the user.
    pub unsupported: Vec<String>,
    /// Inodes of TCP connections with `SO_REUSEADDR` set (leaving repair mode clears it).
    pub reuse_addr: HashSet<u64>,
}

impl TreeSockets {
    pub fn has_established_tcp(&self) -> bool {
        self.records.iter().any(is_connection)
    }

    /// Whether CRIU must be told to dump established connections: the tree has one, or has
    /// a listener that may accept one between this survey and the freeze.
    pub fn may_hold_connections(&self) -> bool {
        self.records.iter().any(|r| r.kind == SocketKind::Tcp.name())
    }

    pub fn has_unix(&self) -> bool {
        self.records.iter().any(|r| r.kind == SocketKind::Unix.name())
    }

    /// Why the tree cannot be dumped for its sockets, if it cannot: a kind CRIU does not
    /// know, network sockets this CRIU cannot dump here, or connections nothing can lock.
    pub fn refusal(
        &self,
        network: &Result<(), String>,
        lock: &Result<NetworkLock, String>,
    ) -> Option<String> {
        if !self.unsupported.is_empty() {
            return Some(format!("CRIU cannot checkpoint {}", self.unsupported.join("; ")));
        }
        if let (true, Err(why)) = (needs_network_support(&self.records), network) {
            return Some(format!("the tree holds network sockets, and {why}"));
        }
        if let (true, Err(why)) = (self.has_established_tcp(), lock) {
            return Some(format!(
                "the tree holds established TCP connections, which must be locked during the dump, \
                 and {why}"
            ));
        }
        None
    }
}

/// Whether `records` hold sockets that only a CRIU able to dump network sockets on this kernel
/// can take: any but Unix and netlink ones.
pub fn needs_network_support(records: &[SocketRecord]) -> bool {
    let plain = [SocketKind::Unix.name(), SocketKind::Netlink.name()];
    records.iter().any(|r| !plain.contains(&r.kind.as_str()))
}

/// A TCP socket that is (or was) connected: CRIU's tcp-established territory.
fn is_connection(r: &SocketRecord) -> bool {
    r.kind == SocketKind::Tcp.name() && !matches!(r.state.as_str(), "listen" | "close" | "")
}

/// The socket tables of every network namespace the tree uses, read as needed.
struct Tables {
    own_netns: Option<u64>,
    by_netns: HashMap<u64, SocketTable>,
}

impl Tables {
    /// The table row of socket `inode` of `pid`, reading the namespace's tables again once
    /// when it is missing (the socket may be younger than the table).
    fn lookup(&mut self, pid: i32, netns: u64, inode: u64) -> Option<net::SocketEntry> {
        let table = self.by_netns.entry(netns).or_insert_with(|| SocketTable::of(pid));
        if let Some(entry) = table.by_inode.get(&inode) {
            return Some(entry.clone());
        }
        *table = SocketTable::of(pid);
        table.by_inode.get(&inode).cloned()
    }
}

/// Looks at every socket descriptor of `pids`.
pub fn survey(pids: &[i32]) -> TreeSockets {
    let mut tables = Tables { own_netns: net::own_netns().ok(), by_netns: HashMap::new() };
    let mut found = TreeSockets::default();
    for &pid in pids {
        let (Ok(netns), Ok(fds)) = (net::netns_of(pid), proc::fd_targets(pid)) else { continue };
        for (fd, target) in fds {
            let Some(inode) = net::socket_inode(&target) else { continue };
            let foreign_netns = tables.own_netns != Some(netns);
            let Some(entry) = tables.lookup(pid, netns, inode) else {
                unlisted(pid, fd, foreign_netns, &mut found);
                continue;
            };
            let record = record_of(pid, fd, &entry, foreign_netns);
            if is_connection(&record) && net::reuse_addr(pid, fd).unwrap_or(false) {
                found.reuse_addr.insert(inode);
            }
            found.records.push(record);
        }
    }
    let ends: HashSet<(String, String)> = found
        .records
        .iter()
        .filter(|r| is_connection(r))
        .map(|r| (r.local.clone(), r.remote.clone()))
        .collect();
    for r in found.records.iter_mut().filter(|r| is_connection(r)) {
        r.peer_in_tree = ends.contains(&(r.remote.clone(), r.local.clone()));
    }
    found
}

fn record_of(pid: i32, fd: i32, entry: &net::SocketEntry, foreign_netns: bool) -> SocketRecord {
    let state = match (entry.kind, entry.listening) {
        (SocketKind::Unix, true) => "listen",
        _ => entry.state,
    };
    SocketRecord {
        pid,
        fd,
        kind: entry.kind.name().into(),
        state: state.into(),
        local: entry.local.map(|a| a.to_string()).or_else(|| entry.path.clone()).unwrap_or_default(),
        remote: entry.remote.map(|a| a.to_string()).unwrap_or_default(),
        peer_in_tree: false,
        foreign_netns,
    }
}

/// A socket no table lists: a family CRIU cannot dump is refused; one it can (a protocol the
/// tables do not show, such as SCTP or ICMP) is recorded by its family and left to CRIU.
fn unlisted(pid: i32, fd: i32, foreign_netns: bool, found: &mut TreeSockets) {
    match net::socket_family(pid, fd) {
        Ok(family) if DUMPABLE_FAMILIES.contains(&family) => found.records.push(SocketRecord {
            pid,
            fd,
            kind: net::family_name(family).to_lowercase(),
            foreign_netns,
            ..Default::default()
        }),
        Ok(family) => {
            let comm = ProcStat::read(pid).map(|s| s.comm).unwrap_or_default();
            found
                .unsupported
                .push(format!("the {} socket of pid {pid} ({comm}), fd {fd}", net::family_name(family)));
        }
        // Closed meanwhile, or not inspectable: CRIU will see what it is.
        Err(e) => debug!(pid, fd, error = %e, "socket not inspected"),
    }
}

/// Takes every TCP socket of `pids` out of repair mode, setting `SO_REUSEADDR` back where
/// `reuse_addr` lists the socket's inode. Blocking. Returns the connections that were in repair
/// mode, and what could not be undone.
pub fn leave_repair(pids: &[i32], reuse_addr: &HashSet<u64>) -> (Vec<Connection>, Vec<String>) {
    let (mut reopened, mut problems) = (Vec::new(), Vec::new());
    for &pid in pids {
        let Ok(fds) = proc::fd_targets(pid) else { continue };
        for (fd, target) in fds {
            let Some(inode) = net::socket_inode(&target) else { continue };
            match net::leave_repair(pid, fd, reuse_addr.contains(&inode)) {
                Ok(Some(ends)) => reopened.push(ends),
                Ok(None) => {}
                Err(e) => problems.push(format!("pid {pid} fd {fd} stays in TCP repair mode: {e}")),
            }
        }
    }
    if !reopened.is_empty() {
        info!(connections = reopened.len(), "connections taken out of repair mode");
    }
    (reopened, problems)
}

/// One line for `stasis show`: "tcp established 127.0.0.1:40000 -> 127.0.0.1:8080 (pid 7)".
pub fn describe(r: &SocketRecord) -> String {
    let mut line = r.kind.clone();
    for part in [&r.state, &r.local] {
        if !part.is_empty() {
            line = format!("{line} {part}");
        }
    }
    if !r.remote.is_empty() {
        line = format!("{line} -> {}", r.remote);
        if is_connection(r) && !r.peer_in_tree {
            line.push_str(" (peer outside the tree)");
        }
    }
    if r.foreign_netns {
        line.push_str(" [own network namespace]");
    }
    format!("{line}, pid {} fd {}", r.pid, r.fd)
}

#[cfg(test)]
pub(super) fn record(kind: &str, state: &str, local: &str, remote: &str) -> SocketRecord {
    SocketRecord {
        pid: 7,
        fd: 3,
        kind: kind.into(),
        state: state.into(),
        local: local.into(),
        remote: remote.into(),
        ..Default::default()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn refusals_name_the_reason() {
        let ok = Ok(());
        let nft = Ok(NetworkLock::Nftables);
        let mut tree =
            TreeSockets { records: vec![record("unix", "listen", "/run/x", "")], ..Default::default() };
        let old = Err("CRIU 4.1.1 cannot dump network sockets".to_string());
        assert_eq!(tree.refusal(&old, &nft), None, "Unix sockets need no new CRIU");
        tree.records.push(record("tcp", "listen", "127.0.0.1:80", ""));
        assert_eq!(tree.refusal(&ok, &nft), None);
        assert!(tree.refusal(&old, &nft).unwrap().contains("4.1.1"));
        let none = Err("no lock".to_string());
        assert_eq!(tree.refusal(&ok, &none), None, "a listener needs no lock");
        tree.records.push(record("tcp", "established", "127.0.0.1:1", "10.0.0.1:2"));
        assert!(tree.refusal(&ok, &none).unwrap().contains("no lock"));
        tree.unsupported.push("the AF_VSOCK socket of pid 7 (python3), fd 4".into());
        assert!(tree.refusal(&ok, &nft).unwrap().contains("AF_VSOCK"));
    }

    #[test]
    fn descriptions() {
        let mut r = record("tcp", "established", "127.0.0.1:1", "127.0.0.1:2");
        assert_eq!(
            describe(&r),
            "tcp established 127.0.0.1:1 -> 127.0.0.1:2 (peer outside the tree), pid 7 fd 3"
        );
        r.peer_in_tree = true;
        assert_eq!(describe(&r), "tcp established 127.0.0.1:1 -> 127.0.0.1:2, pid 7 fd 3");
        assert_eq!(describe(&record("unix", "listen", "/run/x", "")), "unix listen /run/x, pid 7 fd 3");
    }

    #[test]
    fn a_survey_pairs_the_ends_of_a_loopback_connection_and_keeps_reuse_addr() {
        let listener = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
        let client = std::net::TcpStream::connect(listener.local_addr().unwrap()).unwrap();
        let (server, _) = listener.accept().unwrap();
        let found = survey(&[std::process::id() as i32]);
        let mine: Vec<&SocketRecord> = found
            .records
            .iter()
            .filter(|r| {
                r.local == client.local_addr().unwrap().to_string()
                    || r.local == server.local_addr().unwrap().to_string()
            })
            .collect();
        let connections: Vec<_> = mine.iter().filter(|r| r.state == "established").collect();
        assert_eq!(connections.len(), 2, "{mine:#?}");
        assert!(connections.iter().all(|r| r.peer_in_tree && !r.foreign_netns), "{connections:#?}");
        // std sets SO_REUSEADDR on listeners; accepted sockets inherit it.
        assert!(!found.reuse_addr.is_empty());
    }
}
