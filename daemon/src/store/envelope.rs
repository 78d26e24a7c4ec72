//! The envelope of stasis's own metadata objects (manifests, pack indexes): magic, format
//! version, length and checksum around a protobuf payload.
//!
//! ```text
//! offset  size  field
//!      0     8  magic: "STASISMF" (manifest) or "STASISPX" (pack index)
//!      8     2  format major version (LE)   readers reject another major
//!     10     2  format minor version (LE)   readers reject a newer minor
//!     12     4  flags (LE), zero
//!     16     8  payload length (LE)         at most MAX_PAYLOAD
//!     24    32  BLAKE3 of the payload
//!     56     n  payload (protobuf)
//! ```

use prost::Message;

/// Magic of manifest objects.
pub const MANIFEST: &[u8; 8] = b"STASISMF";
/// Magic of pack index objects.
pub const PACK_INDEX: &[u8; 8] = b"STASISPX";

const MAJOR: u16 = 1;
const MINOR: u16 = 0;
const HEADER_LEN: usize = 56;
/// Metadata objects hold chunk references, never page data: 256 MiB is far beyond any real
/// one and keeps a corrupted length from allocating without bound.
const MAX_PAYLOAD: u64 = 256 << 20;

/// A metadata object could not be read.
#[derive(Debug, thiserror::Error, PartialEq, Eq)]
pub enum EnvelopeError {
    #[error("bad magic: not this kind of stasis object")]
    BadMagic,
    #[error("truncated: {got} bytes, expected {expected}")]
    Truncated { got: usize, expected: u64 },
    #[error("format {major}.{minor} is not supported (this stasisd reads {MAJOR}.0 to {MAJOR}.{MINOR})")]
    UnsupportedVersion { major: u16, minor: u16 },
    #[error("format flags {0:#x} are unknown to this stasisd")]
    UnknownFlags(u32),
    #[error("payload of {0} bytes exceeds the limit")]
    TooLarge(u64),
    #[error("checksum mismatch: the object is corrupted")]
    ChecksumMismatch,
    #[error("payload does not decode: {0}")]
    Decode(String),
}

/// Frames `message` for storage under `magic`.
pub fn encode(magic: &[u8; 8], message: &impl Message) -> Vec<u8> {
    let payload = message.encode_to_vec();
    let mut out = Vec::with_capacity(HEADER_LEN + payload.len());
    out.extend_from_slice(magic);
    out.extend_from_slice(&MAJOR.to_le_bytes());
    out.extend_from_slice(&MINOR.to_le_bytes());
    out.extend_from_slice(&0u32.to_le_bytes());
    out.extend_from_slice(&(payload.len() as u64).to_le_bytes());
    out.extend_from_slice(blake3::hash(&payload).as_bytes());
    out.extend_from_slice(&payload);
    out
}

/// Checks the frame and decodes the message inside it.
pub fn decode<M: Message + Default>(magic: &[u8; 8], data: &[u8]) -> Result<M, EnvelopeError> {
    if data.len() >= magic.len() && &data[..8] != magic {
        return Err(EnvelopeError::BadMagic);
    }
    if data.len() < HEADER_LEN {
        return Err(EnvelopeError::Truncated { got: data.len(), expected: HEADER_LEN as u64 });
    }
    let le16 = |at: usize| u16::from_le_bytes([data[at], data[at + 1]]);
    let (major, minor) = (le16(8), le16(10));
    if major != MAJOR || minor > MINOR {
        return Err(EnvelopeError::UnsupportedVersion { major, minor });
    }
    let flags = u32::from_le_bytes(data[12..16].try_into().expect("4-byte slice"));
    if flags != 0 {
        return Err(EnvelopeError::UnknownFlags(flags));
    }
    let len = u64::from_le_bytes(data[16..24].try_into().expect("8-byte slice"));
    if len > MAX_PAYLOAD {
        return Err(EnvelopeError::TooLarge(len));
    }
    let payload = &data[HEADER_LEN..];
    if payload.len() as u64 != len {
        return Err(EnvelopeError::Truncated { got: data.len(), expected: HEADER_LEN as u64 + len });
    }
    if blake3::hash(payload).as_bytes() != &data[24..56] {
        return Err(EnvelopeError::ChecksumMismatch);
    }
    M::decode(payload).map_err(|e| EnvelopeError::Decode(e.to_string()))
}

#[cfg(test)]
mod tests {
    use stasis_proto::stasis::v1::Manifest;

    use super::*;

    fn sample() -> Manifest {
        Manifest {
            id: "20261122-101010-abcdef".into(),
            workload: "w".into(),
            root_pid: 7,
            ..Default::default()
        }
    }

    fn decode_manifest(data: &[u8]) -> Result<Manifest, EnvelopeError> {
        decode(MANIFEST, data)
    }

    #[test]
    fn round_trip() {
        assert_eq!(decode_manifest(&encode(MANIFEST, &sample())).unwrap(), sample());
    }

    #[test]
    fn every_flipped_byte_is_detected() {
        let good = encode(MANIFEST, &sample());
        for i in 0..good.len() {
            let mut bad = good.clone();
            bad[i] ^= 0x01;
            assert!(decode_manifest(&bad).is_err(), "flip at byte {i} went unnoticed");
        }
    }

    #[test]
    fn truncation_kinds_and_versions_are_reported() {
        let good = encode(MANIFEST, &sample());
        assert!(matches!(decode_manifest(&good[..good.len() - 1]), Err(EnvelopeError::Truncated { .. })));
        assert!(matches!(decode_manifest(&good[..10]), Err(EnvelopeError::Truncated { .. })));
        let mut newer = good.clone();
        newer[10] = 9;
        assert_eq!(decode_manifest(&newer), Err(EnvelopeError::UnsupportedVersion { major: 1, minor: 9 }));
        assert_eq!(decode::<Manifest>(PACK_INDEX, &good), Err(EnvelopeError::BadMagic));
    }
}
