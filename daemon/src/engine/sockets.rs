//! The sockets of a tree, from its dump to its restore.
//!
//! ```text
//! checkpoint: survey every socket descriptor -> refuse, before anything is frozen, kinds
//!   CRIU cannot dump (and inet sockets when this CRIU cannot dump them on this kernel)
//!   -> record them in the manifest
//! eviction whose storing failed: take the tree's connections out of CRIU's repair mode and
//!   delete CRIU's lock table, so the resumed tree talks again
//! restore: a listener's port taken, or a local address missing -> refuse before CRIU runs;
//!   a loopback peer gone -> warn (the tree will find that connection reset)
//! ```

use std::collections::HashSet;
use std::net::{IpAddr, SocketAddr};
use std::os::fd::AsFd;
use std::path::Path;

use nix::sys::socket::{getsockopt, setsockopt, sockopt};
use stasis_proto::stasis::v1::SocketRecord;
use tracing::{info, warn};

use crate::criu::NetworkLock;
use crate::criu::images::dump_run_id;
use crate::linux::net::{self, SocketKind, SocketTable};
use crate::linux::{nft, proc, sys};

/// What a survey of a tree's descriptors found.
#[derive(Debug, Clone, Default)]
pub struct TreeSockets {
    pub records: Vec<SocketRecord>,
    /// Sockets CRIU cannot dump, described for the user.
    pub unsupported: Vec<String>,
}

impl TreeSockets {
    pub fn has_established_tcp(&self) -> bool {
        self.records.iter().any(is_connection)
    }

    pub fn has_unix(&self) -> bool {
        self.records.iter().any(|r| r.kind == SocketKind::Unix.name())
    }

    fn has_inet(&self) -> bool {
        let inet = [SocketKind::Tcp, SocketKind::Udp, SocketKind::Raw].map(SocketKind::name);
        self.records.iter().any(|r| inet.contains(&r.kind.as_str()))
    }

    /// Why the tree cannot be dumped for its sockets, if it cannot: a kind CRIU does not
    /// know, inet sockets this CRIU cannot dump here, or connections nothing can lock.
    pub fn refusal(&self, inet: &Result<(), String>, lock: &Result<NetworkLock, String>) -> Option<String> {
        if !self.unsupported.is_empty() {
            return Some(format!("CRIU cannot checkpoint {}", self.unsupported.join("; ")));
        }
        if let (true, Err(why)) = (self.has_inet(), inet) {
            return Some(format!("the tree holds inet sockets, and {why}"));
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

/// A TCP socket that is (or was) connected: CRIU's tcp-established territory.
fn is_connection(r: &SocketRecord) -> bool {
    r.kind == SocketKind::Tcp.name() && !matches!(r.state.as_str(), "listen" | "close" | "")
}

/// Looks at every socket descriptor of `pids`, in the network namespace of `pids[0]`.
pub fn survey(pids: &[i32]) -> TreeSockets {
    let Some(&root) = pids.first() else { return TreeSockets::default() };
    let table = SocketTable::of(root);
    let mut found = TreeSockets::default();
    for &pid in pids {
        let Ok(fds) = proc::fd_targets(pid) else { continue };
        for (fd, target) in fds {
            let Some(inode) = net::socket_inode(&target) else { continue };
            let Some(entry) = table.by_inode.get(&inode) else {
                let family = net::socket_family(pid, fd).unwrap_or_else(|e| format!("unknown kind ({e})"));
                let comm = proc::cmdline(pid).ok().and_then(|c| c.into_iter().next()).unwrap_or_default();
                found.unsupported.push(format!("the {family} socket of pid {pid} ({comm}), fd {fd}"));
                continue;
            };
            let local = entry.local.map(|a| a.to_string()).or_else(|| entry.path.clone()).unwrap_or_default();
            let state = match (entry.kind, entry.listening) {
                (SocketKind::Unix, true) => "listen",
                _ => entry.state,
            };
            found.records.push(SocketRecord {
                pid,
                fd,
                kind: entry.kind.name().into(),
                state: state.into(),
                local,
                remote: entry.remote.map(|a| a.to_string()).unwrap_or_default(),
                peer_in_tree: false,
            });
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
    format!("{line}, pid {} fd {}", r.pid, r.fd)
}

/// Checks that this node can take the recorded sockets back before anything is restored.
/// `Err(why)` when it cannot; otherwise what the restored tree will notice.
pub fn check_restore(records: &[SocketRecord], tcp_close: bool) -> Result<Vec<String>, String> {
    let here = SocketTable::own();
    let mut warnings = Vec::new();
    for r in records {
        let kind = match r.kind.as_str() {
            "tcp" => SocketKind::Tcp,
            "udp" => SocketKind::Udp,
            _ => continue,
        };
        let Ok(local) = r.local.parse::<SocketAddr>() else { continue };
        let connection = is_connection(r);
        if connection && tcp_close {
            warnings
                .push(format!("{}: restored closed (--tcp-close); the workload finds it reset", describe(r)));
            continue;
        }
        if !address_is_here(local.ip()) {
            let hint =
                if connection { "; restore with --tcp-close to have such connections reset" } else { "" };
            return Err(format!("{}: address {} is not on this node{hint}", describe(r), local.ip()));
        }
        let binds_port = r.state == "listen" || (kind == SocketKind::Udp && local.port() != 0);
        if binds_port && let Some(&inode) = here.bound_on(kind, local.ip(), local.port()).first() {
            let holders: Vec<String> =
                net::socket_holders(inode).iter().map(|(pid, comm)| format!("pid {pid} ({comm})")).collect();
            let by = if holders.is_empty() { "another socket".to_string() } else { holders.join(", ") };
            return Err(format!("port {}/{} ({}) is in use by {by}", local.port(), r.kind, local.ip()));
        }
        // Only a peer on this node can be seen to be gone; a remote one is out of sight.
        if connection
            && !r.peer_in_tree
            && let Ok(remote) = r.remote.parse::<SocketAddr>()
            && remote.ip().is_loopback()
            && !here.has_tcp(remote, local)
        {
            warnings.push(format!(
                "{}: its peer is gone; the workload will find the connection reset",
                describe(r)
            ));
        }
    }
    Ok(warnings)
}

/// Whether `ip` can be bound on this node.
fn address_is_here(ip: IpAddr) -> bool {
    ip.is_unspecified() || ip.is_loopback() || std::net::UdpSocket::bind((ip, 0)).is_ok()
}

/// Gives the connections of a tree CRIU dumped and left stopped back to it: every
/// connection leaves TCP repair mode, and CRIU's nftables lock table (named after the run id
/// in the dump's inventory) is deleted. Failures are logged: the tree is resumed regardless.
pub fn reopen_connections(records: &[SocketRecord], images_dir: &Path, lock: Option<NetworkLock>) {
    for r in records.iter().filter(|r| is_connection(r)) {
        let off = sys::copy_fd_of(r.pid, r.fd).and_then(|sock| {
            let fd = sock.as_fd();
            if getsockopt(&fd, sockopt::TcpRepair)? != 0 {
                setsockopt(&fd, sockopt::TcpRepair, &0)?;
            }
            Ok(())
        });
        if let Err(e) = off {
            warn!(pid = r.pid, fd = r.fd, error = %e, "cannot take a connection out of repair mode");
        }
    }
    if !records.iter().any(is_connection) {
        return;
    }
    match lock {
        Some(NetworkLock::Nftables) => unlock_nftables(images_dir),
        Some(NetworkLock::Iptables) => {
            warn!("connections locked with iptables stay locked: stasisd removes only nftables locks")
        }
        None => {}
    }
}

/// Length of the lock table's name as CRIU 4.2 writes it: "inet CRIU-<run id>" cut to fit a
/// 32-byte buffer, less the family.
const CUT_TABLE_NAME: usize = 31 - "inet ".len();

/// Deletes the table CRIU locked the dump's connections in. CRIU names it "CRIU-" and its
/// run id, cut short by CRIU 4.2 and whole by later versions: both names are tried.
fn unlock_nftables(images_dir: &Path) {
    let run_id = match dump_run_id(images_dir) {
        Ok(Some(id)) => id,
        Ok(None) => return warn!("the dump records no CRIU run id: its nftables lock cannot be found"),
        Err(e) => return warn!(error = %e, "cannot read the dump's run id: its nftables lock stays"),
    };
    let whole = format!("CRIU-{run_id}");
    let cut: String = whole.chars().take(CUT_TABLE_NAME).collect();
    for name in [cut, whole] {
        match nft::delete_inet_table(&name) {
            Ok(true) => return info!(table = %name, "removed CRIU's network lock"),
            Ok(false) => {}
            Err(e) => warn!(table = %name, error = %e, "cannot remove CRIU's network lock"),
        }
    }
    warn!(run_id = %run_id, "found no nftables lock table of the dump");
}

#[cfg(test)]
mod tests {
    use super::*;

    fn record(kind: &str, state: &str, local: &str, remote: &str) -> SocketRecord {
        SocketRecord {
            pid: 7,
            fd: 3,
            kind: kind.into(),
            state: state.into(),
            local: local.into(),
            remote: remote.into(),
            peer_in_tree: false,
        }
    }

    #[test]
    fn refusals_name_the_reason() {
        let ok = Ok(());
        let nft = Ok(NetworkLock::Nftables);
        let mut tree =
            TreeSockets { records: vec![record("tcp", "listen", "127.0.0.1:80", "")], ..Default::default() };
        assert_eq!(tree.refusal(&ok, &nft), None);
        let old = Err("CRIU 4.1.1 cannot dump inet sockets".to_string());
        assert!(tree.refusal(&old, &nft).unwrap().contains("4.1.1"));
        let none = Err("no lock".to_string());
        assert_eq!(tree.refusal(&ok, &none), None, "a listener needs no lock");
        tree.records.push(record("tcp", "established", "127.0.0.1:1", "10.0.0.1:2"));
        assert!(tree.refusal(&ok, &none).unwrap().contains("no lock"));
        tree.unsupported.push("the AF_ALG socket of pid 7 (python3), fd 4".into());
        assert!(tree.refusal(&ok, &nft).unwrap().contains("AF_ALG"));
    }

    #[test]
    fn a_taken_port_refuses_and_a_free_one_passes() {
        let taken = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
        let addr = taken.local_addr().unwrap().to_string();
        let err = check_restore(&[record("tcp", "listen", &addr, "")], false).unwrap_err();
        assert!(err.contains("in use by pid"), "{err}");
        assert!(err.contains(&std::process::id().to_string()), "{err}");
        drop(taken);
        assert_eq!(check_restore(&[record("tcp", "listen", &addr, "")], false), Ok(vec![]));
    }

    #[test]
    fn a_gone_loopback_peer_is_a_warning_and_a_foreign_address_an_error() {
        let gone = record("tcp", "established", "127.0.0.1:1", "127.0.0.1:2");
        let warnings = check_restore(std::slice::from_ref(&gone), false).unwrap();
        assert!(warnings[0].contains("peer is gone"), "{warnings:?}");
        let closed = check_restore(std::slice::from_ref(&gone), true).unwrap();
        assert!(closed[0].contains("--tcp-close"), "{closed:?}");
        // 192.0.2.0/24 is TEST-NET-1: never a local address.
        let foreign = record("tcp", "established", "192.0.2.7:40000", "192.0.2.8:80");
        let err = check_restore(std::slice::from_ref(&foreign), false).unwrap_err();
        assert!(err.contains("not on this node") && err.contains("--tcp-close"), "{err}");
        assert!(check_restore(&[foreign], true).is_ok());
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
}
