//! What a restore checks of a checkpoint's sockets before anything is started: that this node
//! can take them back (free ports, local addresses present), and what the tree will notice
//! (peers that went away, connections restored closed).

use std::net::{IpAddr, SocketAddr};

use stasis_proto::stasis::store::v1::SocketRecord;

use super::{describe, is_connection};
use crate::engine::host::Host;
use crate::linux::net::SocketKind;

/// `Err(why)` when this node (`host`) cannot take the recorded sockets back; otherwise what
/// the restored tree will notice. Sockets of a network namespace of the tree's own are left to
/// CRIU, which restores the namespace with them.
pub fn check_restore(
    host: &dyn Host,
    records: &[SocketRecord],
    tcp_close: bool,
) -> Result<Vec<String>, String> {
    let here = host.socket_table();
    let mut warnings = Vec::new();
    for r in records.iter().filter(|r| !r.foreign_netns) {
        let Some(kind) =
            SocketKind::from_name(&r.kind).filter(|k| matches!(k, SocketKind::Tcp | SocketKind::Udp))
        else {
            continue;
        };
        let Ok(local) = r.local.parse::<SocketAddr>() else { continue };
        let connection = is_connection(r);
        if connection && tcp_close {
            warnings.push(format!(
                "{}: restored closed (--tcp-close); the workload's next use of it fails",
                describe(r)
            ));
            continue;
        }
        if !address_is_here(local.ip()) {
            let hint = match connection {
                true => "restore with --tcp-close to have such connections reset",
                false => "restore it on a node that has this address",
            };
            return Err(format!("{}: address {} is not on this node; {hint}", describe(r), local.ip()));
        }
        let binds_port = r.state == "listen" || (kind == SocketKind::Udp && local.port() != 0);
        if binds_port && let Some(&inode) = here.bound_on(kind, local.ip(), local.port()).first() {
            let holders: Vec<String> =
                host.socket_holders(inode).iter().map(|(pid, comm)| format!("pid {pid} ({comm})")).collect();
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

#[cfg(test)]
mod tests {
    use super::super::record;
    use super::*;
    use crate::engine::host::LinuxHost;

    #[test]
    fn a_taken_port_refuses_and_a_free_one_passes() {
        let taken = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
        let addr = taken.local_addr().unwrap().to_string();
        let err = check_restore(&LinuxHost, &[record("tcp", "listen", &addr, "")], false).unwrap_err();
        assert!(err.contains("in use by pid"), "{err}");
        assert!(err.contains(&std::process::id().to_string()), "{err}");
        drop(taken);
        assert_eq!(check_restore(&LinuxHost, &[record("tcp", "listen", &addr, "")], false), Ok(vec![]));
    }

    #[test]
    fn a_gone_loopback_peer_is_a_warning_and_a_foreign_address_an_error() {
        let gone = record("tcp", "established", "127.0.0.1:1", "127.0.0.1:2");
        let warnings = check_restore(&LinuxHost, std::slice::from_ref(&gone), false).unwrap();
        assert!(warnings[0].contains("peer is gone"), "{warnings:?}");
        let closed = check_restore(&LinuxHost, std::slice::from_ref(&gone), true).unwrap();
        assert!(closed[0].contains("--tcp-close"), "{closed:?}");
        // 192.0.2.0/24 is TEST-NET-1: never a local address.
        let foreign = record("tcp", "established", "192.0.2.7:40000", "192.0.2.8:80");
        let err = check_restore(&LinuxHost, std::slice::from_ref(&foreign), false).unwrap_err();
        assert!(err.contains("not on this node") && err.contains("--tcp-close"), "{err}");
        assert!(check_restore(&LinuxHost, std::slice::from_ref(&foreign), true).is_ok());
        // In a network namespace of the tree's own, this node's addresses do not matter.
        let contained = SocketRecord { foreign_netns: true, ..foreign };
        assert_eq!(check_restore(&LinuxHost, &[contained], false), Ok(vec![]));
    }
}
