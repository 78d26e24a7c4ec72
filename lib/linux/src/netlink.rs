//! Netlink message framing shared by stasisd's netlink clients (nf_tables, sock_diag): a
//! message is a `struct nlmsghdr` (length, type, flags, sequence, port id) and a body, each
//! padded to 4 bytes.

use std::io;

pub const NLMSG_ERROR: u16 = 2;
pub const NLMSG_DONE: u16 = 3;
pub const NLM_F_REQUEST: u16 = 0x1;
pub const NLM_F_ACK: u16 = 0x4;

/// Length of `struct nlmsghdr`.
pub const HEADER: usize = 16;

/// Appends one netlink message (`struct nlmsghdr` + `body`), padded to 4 bytes.
pub fn message(out: &mut Vec<u8>, kind: u16, flags: u16, seq: u32, body: &[u8]) {
    let len = (HEADER + body.len()) as u32;
    out.extend_from_slice(&len.to_ne_bytes());
    out.extend_from_slice(&kind.to_ne_bytes());
    out.extend_from_slice(&flags.to_ne_bytes());
    out.extend_from_slice(&seq.to_ne_bytes());
    out.extend_from_slice(&0u32.to_ne_bytes());
    out.extend_from_slice(body);
    pad(out);
}

/// Pads `buf` to a multiple of 4 bytes.
pub fn pad(buf: &mut Vec<u8>) {
    buf.resize(buf.len().next_multiple_of(4), 0);
}

/// One message of an answer.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Received<'a> {
    pub kind: u16,
    pub seq: u32,
    pub body: &'a [u8],
}

impl Received<'_> {
    /// The errno an NLMSG_ERROR carries (0: an acknowledgement); `None` for other messages.
    pub fn errno(&self) -> io::Result<Option<i32>> {
        if self.kind != NLMSG_ERROR {
            return Ok(None);
        }
        let error = self.body.get(..4).ok_or_else(malformed)?;
        Ok(Some(-i32::from_ne_bytes(error.try_into().map_err(|_| malformed())?)))
    }
}

/// The messages in `buf`, in order; an error if one's length does not fit.
pub fn messages(buf: &[u8]) -> io::Result<Vec<Received<'_>>> {
    let mut out = Vec::new();
    let mut at = 0;
    while at + HEADER <= buf.len() {
        let word =
            |off: usize| u32::from_ne_bytes(buf[at + off..at + off + 4].try_into().unwrap_or_default());
        let len = word(0) as usize;
        if len < HEADER || at + len > buf.len() {
            return Err(malformed());
        }
        let kind = u16::from_ne_bytes([buf[at + 4], buf[at + 5]]);
        out.push(Received { kind, seq: word(8), body: &buf[at + HEADER..at + len] });
        at += len.next_multiple_of(4);
    }
    Ok(out)
}

fn malformed() -> io::Error {
    io::Error::new(io::ErrorKind::InvalidData, "malformed netlink answer")
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn messages_round_trip_and_truncation_is_refused() {
        let mut buf = Vec::new();
        message(&mut buf, 20, NLM_F_REQUEST, 7, &[1, 2, 3]);
        let mut error = (-libc::ENOENT).to_ne_bytes().to_vec();
        error.extend_from_slice(&[0; 16]);
        message(&mut buf, NLMSG_ERROR, 0, 8, &error);
        assert_eq!(buf.len(), 20 + 36);
        let got = messages(&buf).unwrap();
        assert_eq!(got.len(), 2);
        assert_eq!((got[0].kind, got[0].seq, got[0].body), (20, 7, &[1, 2, 3][..]));
        assert_eq!(got[0].errno().unwrap(), None);
        assert_eq!(got[1].errno().unwrap(), Some(libc::ENOENT));
        assert!(messages(&buf[..buf.len() - 4]).is_err());
    }
}
