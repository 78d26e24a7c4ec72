//! Deleting an nftables table over netlink (NETLINK_NETFILTER), without the `nft` program.
//!
//! CRIU's nftables network lock puts the connections it dumps into a table of its own and
//! leaves that table in place when the dumped tree is left stopped, because the connections are
//! meant to stay silent until a restore takes them over. When stasisd instead resumes such a
//! tree (storing its checkpoint failed), or no restore comes in time, it removes the table.
//!
//! A request is one nf_tables batch: BATCH_BEGIN, the table request (family inet,
//! NFTA_TABLE_NAME), BATCH_END; the kernel answers the request with an NLMSG_ERROR carrying 0
//! or an errno, or refuses the whole batch (no permission, no nf_tables) with an error on
//! BATCH_BEGIN.

use std::io;
use std::os::fd::{AsRawFd, OwnedFd};
use std::time::Duration;

use nix::sys::socket::{
    AddressFamily, MsgFlags, NetlinkAddr, SockFlag, SockProtocol, SockType, recv, sendto, setsockopt, socket,
    sockopt,
};
use nix::sys::time::TimeVal;

use super::netlink::{self, NLM_F_ACK, NLM_F_REQUEST, message, pad};

/// How long the kernel may take to answer; it answers at once, so this only bounds a surprise.
const ANSWER_TIMEOUT: Duration = Duration::from_secs(2);

const NFNL_MSG_BATCH_BEGIN: u16 = 0x10;
const NFNL_MSG_BATCH_END: u16 = 0x11;
const NFNL_SUBSYS_NFTABLES: u16 = 10;
pub const NFT_MSG_NEWTABLE: u16 = 0;
const NFT_MSG_DELTABLE: u16 = 2;
pub const NFT_MSG_NEWCHAIN: u16 = 3;
pub const NFT_MSG_NEWRULE: u16 = 6;
pub const NLM_F_CREATE: u16 = 0x400;
pub const NLM_F_APPEND: u16 = 0x800;
const NFTA_TABLE_NAME: u16 = 1;
const NFPROTO_INET: u8 = 1;
/// `NLA_F_NESTED`: the attribute holds attributes.
const NESTED: u16 = 0x8000;

/// A NETLINK_NETFILTER socket. Tables created with the owner flag through it live as long as
/// it does.
pub struct NftSocket {
    fd: OwnedFd,
    seq: u32,
}

impl NftSocket {
    pub fn open() -> io::Result<NftSocket> {
        let fd = socket(
            AddressFamily::Netlink,
            SockType::Raw,
            SockFlag::SOCK_CLOEXEC,
            SockProtocol::NetlinkNetFilter,
        )?;
        setsockopt(&fd, sockopt::ReceiveTimeout, &TimeVal::new(ANSWER_TIMEOUT.as_secs() as _, 0))?;
        Ok(NftSocket { fd, seq: 0 })
    }

    /// Sends `requests` (each a message kind of nf_tables, flags beyond REQUEST|ACK, and the
    /// body after `struct nfgenmsg`, all of family inet) as one batch, which the kernel applies
    /// whole or not at all; waits until each is acknowledged. The first refusal's errno is the
    /// error.
    pub fn batch(&mut self, requests: &[(u16, u16, Vec<u8>)]) -> io::Result<()> {
        let count = requests.len() as u32;
        let seq = self.seq.wrapping_add(1);
        self.seq = seq.wrapping_add(count + 1);
        let out = batch(requests, seq);
        sendto(self.fd.as_raw_fd(), &out, &NetlinkAddr::new(0, 0), MsgFlags::empty())?;
        let mut acked = 0;
        let mut buf = [0u8; 8192];
        while acked < count {
            // A timeout ends this with EAGAIN.
            let n = recv(self.fd.as_raw_fd(), &mut buf, MsgFlags::empty())?;
            let (acks, refused) = tally(&buf[..n], seq, count)?;
            if let Some(errno) = refused {
                return Err(io::Error::from_raw_os_error(errno));
            }
            acked += acks;
        }
        Ok(())
    }
}

/// Deletes table `name` of family inet. `Ok(false)` when no such table exists.
pub fn delete_inet_table(name: &str) -> io::Result<bool> {
    match NftSocket::open()?.batch(&[(NFT_MSG_DELTABLE, 0, table_body(name))]) {
        Ok(()) => Ok(true),
        Err(e) if e.raw_os_error() == Some(libc::ENOENT) => Ok(false),
        Err(e) => Err(e),
    }
}

/// Creates an empty table `name` of family inet (as CRIU's lock does, for tests).
#[cfg(any(test, feature = "testing"))]
pub fn create_inet_table(name: &str) -> io::Result<bool> {
    NftSocket::open()?.batch(&[(NFT_MSG_NEWTABLE, NLM_F_CREATE, table_body(name))]).map(|()| true)
}

/// The attributes naming table `name`.
pub fn table_body(name: &str) -> Vec<u8> {
    let mut body = Vec::new();
    attr_str(&mut body, NFTA_TABLE_NAME, name);
    body
}

/// Appends attribute `kind` holding `value`.
pub fn attr(buf: &mut Vec<u8>, kind: u16, value: &[u8]) {
    buf.extend_from_slice(&((4 + value.len()) as u16).to_ne_bytes());
    buf.extend_from_slice(&kind.to_ne_bytes());
    buf.extend_from_slice(value);
    pad(buf);
}

/// Appends attribute `kind` holding the NUL-terminated string `value`.
pub fn attr_str(buf: &mut Vec<u8>, kind: u16, value: &str) {
    let mut bytes = value.as_bytes().to_vec();
    bytes.push(0);
    attr(buf, kind, &bytes);
}

/// Appends attribute `kind` holding `value` in network byte order, as nf_tables wants its
/// numbers.
pub fn attr_be32(buf: &mut Vec<u8>, kind: u16, value: u32) {
    attr(buf, kind, &value.to_be_bytes());
}

/// Appends attribute `kind` holding the attributes `inner` writes.
pub fn nested(buf: &mut Vec<u8>, kind: u16, inner: impl FnOnce(&mut Vec<u8>)) {
    let mut value = Vec::new();
    inner(&mut value);
    attr(buf, kind | NESTED, &value);
}

/// A batch: BATCH_BEGIN (`seq`), each request (`seq + 1`, ...), BATCH_END.
fn batch(requests: &[(u16, u16, Vec<u8>)], seq: u32) -> Vec<u8> {
    let mut out = Vec::new();
    let batch_genmsg = nfgenmsg(0, NFNL_SUBSYS_NFTABLES);
    message(&mut out, NFNL_MSG_BATCH_BEGIN, NLM_F_REQUEST, seq, &batch_genmsg);
    let mut at = seq;
    for (kind, flags, attrs) in requests {
        at = at.wrapping_add(1);
        let mut body = nfgenmsg(NFPROTO_INET, 0).to_vec();
        body.extend_from_slice(attrs);
        let kind = (NFNL_SUBSYS_NFTABLES << 8) | kind;
        message(&mut out, kind, NLM_F_REQUEST | NLM_F_ACK | flags, at, &body);
    }
    message(&mut out, NFNL_MSG_BATCH_END, NLM_F_REQUEST, at.wrapping_add(1), &batch_genmsg);
    out
}

/// `struct nfgenmsg`: family, version 0, resource id (big-endian).
fn nfgenmsg(family: u8, res_id: u16) -> [u8; 4] {
    let id = res_id.to_be_bytes();
    [family, 0, id[0], id[1]]
}

/// The answers in `buf` to a batch whose BATCH_BEGIN has sequence `seq`, with `count`
/// requests: how many requests they acknowledge, and the errno of a refusal (of a request, or
/// of the whole batch on its BATCH_BEGIN: no CAP_NET_ADMIN, no nf_tables).
fn tally(buf: &[u8], seq: u32, count: u32) -> io::Result<(u32, Option<i32>)> {
    let mut acks = 0;
    for m in netlink::messages(buf)? {
        let Some(errno) = m.errno()? else { continue };
        let offset = m.seq.wrapping_sub(seq);
        if offset > count + 1 {
            continue;
        }
        match errno {
            0 if offset == 0 || offset == count + 1 => {}
            0 => acks += 1,
            e => return Ok((acks, Some(e))),
        }
    }
    Ok((acks, None))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn batch_layout() {
        let batch = batch(&[(NFT_MSG_DELTABLE, 0, table_body("CRIU-x"))], 7);
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
        assert_eq!(u32::from_ne_bytes(batch[60..64].try_into().unwrap()), 9, "BATCH_END's sequence");
    }

    #[test]
    fn nested_attributes_are_flagged_and_padded() {
        let mut buf = Vec::new();
        nested(&mut buf, 4, |inner| attr(inner, 1, &[7]));
        assert_eq!(buf, [12, 0, 4, 0x80, 5, 0, 1, 0, 7, 0, 0, 0]);
    }

    fn error_message(seq: u32, errno: i32) -> Vec<u8> {
        let mut out = Vec::new();
        let mut body = (-errno).to_ne_bytes().to_vec();
        body.extend_from_slice(&[0; 16]);
        message(&mut out, netlink::NLMSG_ERROR, 0, seq, &body);
        out
    }

    #[test]
    fn answers_are_tallied_per_request_and_any_refusal_ends_the_batch() {
        // Two requests (seq 6 and 7 of a batch starting at 5), acknowledged or refused.
        let mut both = error_message(6, 0);
        both.extend(error_message(7, 0));
        assert_eq!(tally(&both, 5, 2).unwrap(), (2, None));
        assert_eq!(tally(&error_message(7, libc::ENOENT), 5, 2).unwrap(), (0, Some(libc::ENOENT)));
        // The whole batch refused on its BATCH_BEGIN.
        assert_eq!(tally(&error_message(5, libc::EPERM), 5, 2).unwrap(), (0, Some(libc::EPERM)));
        // Another batch's answer, or a success on BATCH_BEGIN or BATCH_END, counts for nothing.
        assert_eq!(tally(&error_message(9, libc::EPERM), 5, 2).unwrap(), (0, None));
        assert_eq!(tally(&error_message(5, 0), 5, 2).unwrap(), (0, None));
        assert_eq!(tally(&error_message(8, 0), 5, 2).unwrap(), (0, None));
        let full = error_message(6, 0);
        assert!(tally(&full[..full.len() - 20], 5, 1).is_err());
    }

    #[test]
    fn deleting_a_missing_table_says_so() {
        let deleted = delete_inet_table("stasis-test-no-such-table");
        match nix::unistd::geteuid().is_root() {
            true => assert!(!deleted.unwrap()),
            false => assert!(deleted.is_err(), "only root may change nftables"),
        }
    }
}
