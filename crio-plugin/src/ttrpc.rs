//! ttRPC's framing: each message is a 10-byte header (payload length and stream id, both
//! big-endian u32; message type; flags) followed by a protobuf `Request` or `Response`.

/// Message types.
pub const REQUEST: u8 = 1;
pub const RESPONSE: u8 = 2;

/// The largest message ttRPC accepts.
pub const MAX_MESSAGE: usize = 4 << 20;

const HEADER: usize = 10;

/// One ttRPC message.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Frame {
    pub stream: u32,
    pub kind: u8,
    pub payload: Vec<u8>,
}

#[derive(Debug, thiserror::Error, PartialEq, Eq)]
#[error("a ttRPC message of {0} bytes is over the 4 MiB limit")]
pub struct TooLarge(pub usize);

impl Frame {
    pub fn encode(&self) -> Vec<u8> {
        let mut out = Vec::with_capacity(HEADER + self.payload.len());
        out.extend_from_slice(&(self.payload.len() as u32).to_be_bytes());
        out.extend_from_slice(&self.stream.to_be_bytes());
        out.extend_from_slice(&[self.kind, 0]);
        out.extend_from_slice(&self.payload);
        out
    }

    /// Takes one whole message off the front of `buf`, if it holds one.
    pub fn take(buf: &mut Vec<u8>) -> Result<Option<Frame>, TooLarge> {
        if buf.len() < HEADER {
            return Ok(None);
        }
        let len = u32::from_be_bytes(buf[0..4].try_into().expect("4 bytes")) as usize;
        if len > MAX_MESSAGE {
            return Err(TooLarge(len));
        }
        if buf.len() < HEADER + len {
            return Ok(None);
        }
        let stream = u32::from_be_bytes(buf[4..8].try_into().expect("4 bytes"));
        let kind = buf[8];
        let payload = buf[HEADER..HEADER + len].to_vec();
        buf.drain(..HEADER + len);
        Ok(Some(Frame { stream, kind, payload }))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn messages_come_back_whole_however_the_bytes_arrive() {
        let frames = [
            Frame { stream: 1, kind: REQUEST, payload: b"register".to_vec() },
            Frame { stream: 3, kind: RESPONSE, payload: Vec::new() },
        ];
        let bytes: Vec<u8> = frames.iter().flat_map(Frame::encode).collect();
        let mut buf = Vec::new();
        let mut got = Vec::new();
        for byte in bytes {
            buf.push(byte);
            while let Some(frame) = Frame::take(&mut buf).unwrap() {
                got.push(frame);
            }
        }
        assert_eq!(got, frames);
        assert!(buf.is_empty());
    }

    #[test]
    fn an_oversized_message_is_refused_before_it_is_read() {
        let mut buf = Frame { stream: 1, kind: REQUEST, payload: Vec::new() }.encode();
        buf[0..4].copy_from_slice(&((MAX_MESSAGE + 1) as u32).to_be_bytes());
        assert_eq!(Frame::take(&mut buf), Err(TooLarge(MAX_MESSAGE + 1)));
    }
}
