//! The envelope of stasis's own metadata objects (manifests, pack indexes): magic, format
//! version, length and checksum around a protobuf payload.
//!
//! ```text
//! offset  size  field
//!      0     8  magic: "STASISMF" (manifest) or "STASISPX" (pack index)
//!      8     2  format major version (LE)   readers reject another major
//!     10     2  format minor version (LE)   readers reject a newer minor
//!                                            (manifests 1.1 where a chunk reference takes a
//!                                            part of a chunk, else 1.0; pack indexes 1.0)
//!     12     4  flags (LE): bit 0 = payload sealed with the store's key (see crypto.rs)
//!     16     8  payload length (LE)         at most MAX_PAYLOAD
//!     24    32  BLAKE3 of the payload
//!     56     n  payload (protobuf, or sealed protobuf)
//! ```

use prost::Message;

use super::crypto::Cipher;

/// Magic of manifest objects.
pub const MANIFEST: &[u8; 8] = b"STASISMF";
/// Magic of pack index objects.
pub const PACK_INDEX: &[u8; 8] = b"STASISPX";

const MAJOR: u16 = 1;
const HEADER_LEN: usize = 56;
/// Metadata objects hold chunk references, never page data: 256 MiB is far beyond any real
/// one and keeps a corrupted length from allocating without bound.
const MAX_PAYLOAD: u64 = 256 << 20;
/// Flag: the payload is sealed.
const SEALED: u32 = 1;

/// A metadata object could not be read.
#[derive(Debug, thiserror::Error, PartialEq, Eq)]
pub enum EnvelopeError {
    #[error("bad magic: not this kind of stasis object")]
    BadMagic,
    #[error("truncated: {got} bytes, expected {expected}")]
    Truncated { got: usize, expected: u64 },
    #[error("format {major}.{minor} is not supported (this stasisd reads {MAJOR}.0 to {MAJOR}.{newest})")]
    UnsupportedVersion { major: u16, minor: u16, newest: u16 },
    #[error("format flags {0:#x} are unknown to this stasisd")]
    UnknownFlags(u32),
    #[error("payload of {0} bytes exceeds the limit")]
    TooLarge(u64),
    #[error("checksum mismatch: the object is corrupted")]
    ChecksumMismatch,
    #[error("it is encrypted, and no store key is configured")]
    NeedsKey,
    #[error("it does not decrypt with the store key (damaged, or written under another key)")]
    Undecryptable,
    #[error("it is not encrypted, in an encrypted store: refused (it may have been planted)")]
    NotSealed,
    #[error("payload does not decode: {0}")]
    Decode(String),
}

/// The minor format version of a manifest whose chunk references take parts of chunks
/// (`ChunkRef.offset`): a reader that would take whole chunks must refuse it.
pub const MANIFEST_WITH_PARTS: u16 = 1;

/// The newest minor format version of objects under `magic` that this stasisd reads.
fn minor(magic: &[u8; 8]) -> u16 {
    if magic == MANIFEST { MANIFEST_WITH_PARTS } else { 0 }
}

/// Frames `message` for storage under `magic` as format 1.0, sealed when the store has a
/// `cipher`.
pub fn encode(magic: &[u8; 8], message: &impl Message, cipher: Option<&Cipher>) -> Vec<u8> {
    encode_as(magic, 0, message, cipher)
}

/// [`encode`] as format 1.`minor`.
pub fn encode_as(magic: &[u8; 8], minor: u16, message: &impl Message, cipher: Option<&Cipher>) -> Vec<u8> {
    let plain = message.encode_to_vec();
    let (payload, flags) = match cipher {
        Some(c) => (c.seal(magic, &plain), SEALED),
        None => (plain, 0),
    };
    let mut out = Vec::with_capacity(HEADER_LEN + payload.len());
    out.extend_from_slice(magic);
    out.extend_from_slice(&MAJOR.to_le_bytes());
    out.extend_from_slice(&minor.to_le_bytes());
    out.extend_from_slice(&flags.to_le_bytes());
    out.extend_from_slice(&(payload.len() as u64).to_le_bytes());
    out.extend_from_slice(blake3::hash(&payload).as_bytes());
    out.extend_from_slice(&payload);
    out
}

/// Checks the frame and decodes the message inside it, opening it with `cipher` (an encrypted
/// store's objects must all be sealed).
pub fn decode<M: Message + Default>(
    magic: &[u8; 8],
    data: &[u8],
    cipher: Option<&Cipher>,
) -> Result<M, EnvelopeError> {
    if data.len() >= magic.len() && &data[..8] != magic {
        return Err(EnvelopeError::BadMagic);
    }
    if data.len() < HEADER_LEN {
        return Err(EnvelopeError::Truncated { got: data.len(), expected: HEADER_LEN as u64 });
    }
    let le16 = |at: usize| u16::from_le_bytes([data[at], data[at + 1]]);
    let (major, minor) = (le16(8), le16(10));
    if major != MAJOR || minor > self::minor(magic) {
        return Err(EnvelopeError::UnsupportedVersion { major, minor, newest: self::minor(magic) });
    }
    let flags = u32::from_le_bytes(data[12..16].try_into().expect("4-byte slice"));
    if flags & !SEALED != 0 {
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
    let opened;
    let plain = match (flags & SEALED != 0, cipher) {
        (false, None) => payload,
        (false, Some(_)) => return Err(EnvelopeError::NotSealed),
        (true, None) => return Err(EnvelopeError::NeedsKey),
        (true, Some(c)) => {
            opened = c.open(magic, payload).ok_or(EnvelopeError::Undecryptable)?;
            &opened
        }
    };
    M::decode(plain).map_err(|e| EnvelopeError::Decode(e.to_string()))
}

#[cfg(test)]
mod tests {
    use stasis_proto::stasis::store::v1::Manifest;

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
        decode(MANIFEST, data, None)
    }

    #[test]
    fn round_trip() {
        assert_eq!(decode_manifest(&encode(MANIFEST, &sample(), None)).unwrap(), sample());
    }

    #[test]
    fn every_flipped_byte_is_detected() {
        let good = encode(MANIFEST, &sample(), None);
        for i in 0..good.len() {
            let mut bad = good.clone();
            bad[i] ^= 0x01;
            match decode_manifest(&bad) {
                Err(_) => {}
                // Format 1.0 read as 1.1: the same manifest (the version is not checksummed).
                Ok(read) => assert!(i == 10 && read == sample(), "flip at byte {i} went unnoticed"),
            }
        }
    }

    #[test]
    fn truncation_kinds_and_versions_are_reported() {
        let good = encode(MANIFEST, &sample(), None);
        assert!(matches!(decode_manifest(&good[..good.len() - 1]), Err(EnvelopeError::Truncated { .. })));
        assert!(matches!(decode_manifest(&good[..10]), Err(EnvelopeError::Truncated { .. })));
        let mut newer = good.clone();
        newer[10] = 9;
        assert_eq!(
            decode_manifest(&newer),
            Err(EnvelopeError::UnsupportedVersion { major: 1, minor: 9, newest: 1 })
        );
        let with_parts = encode_as(MANIFEST, MANIFEST_WITH_PARTS, &sample(), None);
        assert_eq!(&with_parts[10..12], &[1, 0]);
        assert_eq!(decode_manifest(&with_parts).unwrap(), sample(), "format 1.1 is read");
        assert_eq!(&good[10..12], &[0, 0], "format 1.0 unless asked");
        let index = encode_as(PACK_INDEX, 1, &sample(), None);
        assert_eq!(
            decode::<Manifest>(PACK_INDEX, &index, None),
            Err(EnvelopeError::UnsupportedVersion { major: 1, minor: 1, newest: 0 }),
            "pack indexes stay 1.0"
        );
        assert_eq!(decode::<Manifest>(PACK_INDEX, &good, None), Err(EnvelopeError::BadMagic));
    }

    #[test]
    fn sealed_envelopes_need_the_key_and_an_encrypted_store_takes_only_sealed_ones() {
        let key = crate::crypto::StoreKey::from_hex(&"11".repeat(32)).unwrap();
        let (_, cipher) = key.new_keys_object();
        let sealed = encode(MANIFEST, &sample(), Some(&cipher));
        assert!(!sealed.windows(6).any(|w| w == b"101010"), "the id is not readable in it");
        assert_eq!(decode::<Manifest>(MANIFEST, &sealed, Some(&cipher)).unwrap(), sample());
        assert_eq!(decode::<Manifest>(MANIFEST, &sealed, None), Err(EnvelopeError::NeedsKey));
        let (_, other) = key.new_keys_object();
        assert_eq!(decode::<Manifest>(MANIFEST, &sealed, Some(&other)), Err(EnvelopeError::Undecryptable));
        let plain = encode(MANIFEST, &sample(), None);
        assert_eq!(decode::<Manifest>(MANIFEST, &plain, Some(&cipher)), Err(EnvelopeError::NotSealed));
    }
}
