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
use std::os::fd::AsRawFd;
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
#[cfg(test)]
const NFT_MSG_NEWTABLE: u16 = 0;
const NFT_MSG_DELTABLE: u16 = 2;
#[cfg(test)]
const NLM_F_CREATE: u16 = 0x400;
const NFTA_TABLE_NAME: u16 = 1;
const NFPROTO_INET: u8 = 1;

/// Deletes table `name` of family inet. `Ok(false)` when no such table exists.
pub fn delete_inet_table(name: &str) -> io::Result<bool> {
    table_request(NFT_MSG_DELTABLE, 0, name)
}

/// Creates an empty table `name` of family inet (as CRIU's lock does, for tests).
#[cfg(test)]
pub fn create_inet_table(name: &str) -> io::Result<bool> {
    table_request(NFT_MSG_NEWTABLE, NLM_F_CREATE, name)
}

/// Sends one table request (`kind`, with `flags` beyond REQUEST|ACK) in a batch and waits
/// for its answer. `Ok(false)` when no such table exists.
fn table_request(kind: u16, flags: u16, name: &str) -> io::Result<bool> {
    let sock = socket(
        AddressFamily::Netlink,
        SockType::Raw,
        SockFlag::SOCK_CLOEXEC,
        SockProtocol::NetlinkNetFilter,
    )?;
    setsockopt(&sock, sockopt::ReceiveTimeout, &TimeVal::new(ANSWER_TIMEOUT.as_secs() as _, 0))?;
    let seq = 1;
    let batch = table_batch(kind, flags, name, seq);
    sendto(sock.as_raw_fd(), &batch, &NetlinkAddr::new(0, 0), MsgFlags::empty())?;
    let mut buf = [0u8; 8192];
    loop {
        // A timeout ends this with EAGAIN.
        let n = recv(sock.as_raw_fd(), &mut buf, MsgFlags::empty())?;
        match answer(&buf[..n], seq)? {
            Some(0) => return Ok(true),
            Some(e) if e == libc::ENOENT => return Ok(false),
            Some(e) => return Err(io::Error::from_raw_os_error(e)),
            None => {}
        }
    }
}

/// The batch's outcome among the messages in `buf`, if they settle it: the errno of an error
/// on any of its three messages, or 0 for the request's acknowledgement.
fn answer(buf: &[u8], seq: u32) -> io::Result<Option<i32>> {
    for (at_seq, errno) in errors(buf)? {
        if (seq..=seq + 2).contains(&at_seq) && (errno != 0 || at_seq == seq + 1) {
            return Ok(Some(errno));
        }
    }
    Ok(None)
}

/// The three messages of a batch with one table request (`kind`) for table `name`; the
/// request has sequence `seq + 1`.
fn table_batch(kind: u16, flags: u16, name: &str, seq: u32) -> Vec<u8> {
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
    let kind = (NFNL_SUBSYS_NFTABLES << 8) | kind;
    message(&mut out, kind, NLM_F_REQUEST | NLM_F_ACK | flags, seq + 1, &body);
    message(&mut out, NFNL_MSG_BATCH_END, NLM_F_REQUEST, seq + 2, &batch_genmsg);
    out
}

/// `struct nfgenmsg`: family, version 0, resource id (big-endian).
fn nfgenmsg(family: u8, res_id: u16) -> [u8; 4] {
    let id = res_id.to_be_bytes();
    [family, 0, id[0], id[1]]
}

/// The NLMSG_ERROR messages in `buf`: the sequence each answers, and its errno (0: success).
fn errors(buf: &[u8]) -> io::Result<Vec<(u32, i32)>> {
    let mut out = Vec::new();
    for m in netlink::messages(buf)? {
        if let Some(errno) = m.errno()? {
            out.push((m.seq, errno));
        }
    }
    Ok(out)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn batch_layout() {
        let batch = table_batch(NFT_MSG_DELTABLE, 0, "CRIU-x", 7);
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

    fn error_message(seq: u32, errno: i32) -> Vec<u8> {
        let mut out = Vec::new();
        let mut body = (-errno).to_ne_bytes().to_vec();
        body.extend_from_slice(&[0; 16]);
        message(&mut out, netlink::NLMSG_ERROR, 0, seq, &body);
        out
    }

    #[test]
    fn answers_settle_on_the_deltable_ack_or_any_error_of_the_batch() {
        // The DELTABLE (seq 6 of a batch starting at 5) acknowledged, or refused.
        assert_eq!(answer(&error_message(6, 0), 5).unwrap(), Some(0));
        assert_eq!(answer(&error_message(6, libc::ENOENT), 5).unwrap(), Some(libc::ENOENT));
        // The whole batch refused on its BATCH_BEGIN (no CAP_NET_ADMIN, no nf_tables).
        assert_eq!(answer(&error_message(5, libc::EPERM), 5).unwrap(), Some(libc::EPERM));
        // Another request's answer, or a success on BATCH_BEGIN, settles nothing.
        assert_eq!(answer(&error_message(9, libc::EPERM), 5).unwrap(), None);
        assert_eq!(answer(&error_message(5, 0), 5).unwrap(), None);
        let full = error_message(6, 0);
        assert!(answer(&full[..full.len() - 20], 5).is_err());
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
