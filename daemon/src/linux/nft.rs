//! Deleting an nftables table over netlink (NETLINK_NETFILTER), without the `nft` program.
//!
//! CRIU's nftables network lock puts the connections it dumps into a table of its own and
//! leaves that table in place when the dumped tree is left stopped, because the connections are
//! meant to stay silent until a restore takes them over. When stasisd instead resumes such a
//! tree (storing its checkpoint failed), it removes the table itself.
//!
//! The request is one nf_tables batch: BATCH_BEGIN, DELTABLE (family inet, NFTA_TABLE_NAME),
//! BATCH_END; the kernel answers the DELTABLE with an NLMSG_ERROR carrying 0 or an errno.

use std::io;

use nix::sys::socket::{
    AddressFamily, MsgFlags, NetlinkAddr, SockFlag, SockProtocol, SockType, recv, sendto, socket,
};
use std::os::fd::AsRawFd;

const NLMSG_ERROR: u16 = 2;
const NLM_F_REQUEST: u16 = 0x1;
const NLM_F_ACK: u16 = 0x4;
const NFNL_MSG_BATCH_BEGIN: u16 = 0x10;
const NFNL_MSG_BATCH_END: u16 = 0x11;
const NFNL_SUBSYS_NFTABLES: u16 = 10;
const NFT_MSG_DELTABLE: u16 = 2;
const NFTA_TABLE_NAME: u16 = 1;
const NFPROTO_INET: u8 = 1;

/// Deletes table `name` of family inet. `Ok(false)` when no such table exists.
pub fn delete_inet_table(name: &str) -> io::Result<bool> {
    let sock = socket(
        AddressFamily::Netlink,
        SockType::Raw,
        SockFlag::SOCK_CLOEXEC,
        SockProtocol::NetlinkNetFilter,
    )?;
    let seq = 1;
    let batch = delete_table_batch(name, seq);
    sendto(sock.as_raw_fd(), &batch, &NetlinkAddr::new(0, 0), MsgFlags::empty())?;
    let mut buf = [0u8; 8192];
    loop {
        let n = recv(sock.as_raw_fd(), &mut buf, MsgFlags::empty())?;
        if let Some(errno) = ack_for(&buf[..n], seq + 1)? {
            return match errno {
                0 => Ok(true),
                e if e == libc::ENOENT => Ok(false),
                e => Err(io::Error::from_raw_os_error(e)),
            };
        }
    }
}

/// The three messages of a batch deleting table `name`; the DELTABLE has sequence `seq + 1`.
fn delete_table_batch(name: &str, seq: u32) -> Vec<u8> {
    let mut out = Vec::new();
    let batch_genmsg = nfgenmsg(0, NFNL_SUBSYS_NFTABLES);
    message(&mut out, NFNL_MSG_BATCH_BEGIN, NLM_F_REQUEST, seq, &batch_genmsg);
    let mut body = nfgenmsg(NFPROTO_INET, 0).to_vec();
    let mut value = name.as_bytes().to_vec();
    value.push(0);
    body.extend_from_slice(&((4 + value.len()) as u16).to_ne_bytes());
    body.extend_from_slice(&NFTA_TABLE_NAME.to_ne_bytes());
    body.extend_from_slice(&value);
    pad(&mut body);
    let kind = (NFNL_SUBSYS_NFTABLES << 8) | NFT_MSG_DELTABLE;
    message(&mut out, kind, NLM_F_REQUEST | NLM_F_ACK, seq + 1, &body);
    message(&mut out, NFNL_MSG_BATCH_END, NLM_F_REQUEST, seq + 2, &batch_genmsg);
    out
}

/// `struct nfgenmsg`: family, version 0, resource id (big-endian).
fn nfgenmsg(family: u8, res_id: u16) -> [u8; 4] {
    let id = res_id.to_be_bytes();
    [family, 0, id[0], id[1]]
}

/// Appends one netlink message (`struct nlmsghdr` + body), padded to 4 bytes.
fn message(out: &mut Vec<u8>, kind: u16, flags: u16, seq: u32, body: &[u8]) {
    let len = (16 + body.len()) as u32;
    out.extend_from_slice(&len.to_ne_bytes());
    out.extend_from_slice(&kind.to_ne_bytes());
    out.extend_from_slice(&flags.to_ne_bytes());
    out.extend_from_slice(&seq.to_ne_bytes());
    out.extend_from_slice(&0u32.to_ne_bytes());
    out.extend_from_slice(body);
    pad(out);
}

fn pad(buf: &mut Vec<u8>) {
    buf.resize(buf.len().next_multiple_of(4), 0);
}

/// The errno (0 for success) of the NLMSG_ERROR answering sequence `seq` among the messages
/// in `buf`, if there is one.
fn ack_for(buf: &[u8], seq: u32) -> io::Result<Option<i32>> {
    let malformed = || io::Error::new(io::ErrorKind::InvalidData, "malformed netlink answer");
    let mut at = 0;
    while at + 16 <= buf.len() {
        let field =
            |off: usize| u32::from_ne_bytes(buf[at + off..at + off + 4].try_into().unwrap_or_default());
        let len = field(0) as usize;
        let kind = u16::from_ne_bytes([buf[at + 4], buf[at + 5]]);
        if len < 16 || at + len > buf.len() {
            return Err(malformed());
        }
        if kind == NLMSG_ERROR && field(8) == seq {
            let error = buf.get(at + 16..at + 20).ok_or_else(malformed)?;
            return Ok(Some(-i32::from_ne_bytes(error.try_into().unwrap_or_default())));
        }
        at += len.next_multiple_of(4);
    }
    Ok(None)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn batch_layout() {
        let batch = delete_table_batch("CRIU-x", 7);
        // BATCH_BEGIN (20 bytes), DELTABLE (16 + 4 + 4 + 7 -> 32), BATCH_END (20).
        assert_eq!(batch.len(), 20 + 32 + 20);
        assert_eq!(u16::from_ne_bytes([batch[4], batch[5]]), NFNL_MSG_BATCH_BEGIN);
        assert_eq!(&batch[16..20], &[0, 0, 0, 10]);
        let del = &batch[20..52];
        assert_eq!(u32::from_ne_bytes(del[0..4].try_into().unwrap()), 32);
        assert_eq!(u16::from_ne_bytes([del[4], del[5]]), 0x0a02);
        assert_eq!(u32::from_ne_bytes(del[8..12].try_into().unwrap()), 8);
        assert_eq!(del[16], NFPROTO_INET);
        assert_eq!(&del[24..31], b"CRIU-x\0");
    }

    #[test]
    fn acks_are_matched_by_sequence() {
        let mut answer = Vec::new();
        let mut err = (-libc::ENOENT).to_ne_bytes().to_vec();
        err.extend_from_slice(&[0; 16]);
        message(&mut answer, NLMSG_ERROR, 0, 5, &err);
        assert_eq!(ack_for(&answer, 5).unwrap(), Some(libc::ENOENT));
        assert_eq!(ack_for(&answer, 6).unwrap(), None);
        assert!(ack_for(&answer[..answer.len() - 20], 5).is_err());
    }

    #[test]
    fn deleting_a_missing_table_says_so() {
        if !nix::unistd::geteuid().is_root() {
            return;
        }
        assert!(!delete_inet_table("stasis-test-no-such-table").unwrap());
    }
}
