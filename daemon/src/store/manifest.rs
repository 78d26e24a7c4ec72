//! The manifest envelope: how a [`Manifest`] is framed in its object.
//!
//! ```text
//! offset  size  field
//!      0     8  magic "STASISMF"
//!      8     2  format major version (LE)   readers reject another major
//!     10     2  format minor version (LE)   readers reject a newer minor
//!     12     4  flags (LE), zero
//!     16     8  payload length (LE)         at most MAX_PAYLOAD
//!     24    32  BLAKE3 of the payload
//!     56     n  payload: stasis.v1.Manifest (protobuf)
//! ```

use prost::Message;
pub use stasis_proto::stasis::v1::Manifest;

const MAGIC: &[u8; 8] = b"STASISMF";
const MAJOR: u16 = 1;
const MINOR: u16 = 0;
const HEADER_LEN: usize = 56;
/// Manifests list files and chunk references, never page data: 64 MiB is far beyond any real
/// one and keeps a corrupted length from allocating without bound.
const MAX_PAYLOAD: u64 = 64 << 20;

/// A manifest object could not be read.
#[derive(Debug, thiserror::Error, PartialEq, Eq)]
pub enum ManifestError {
    #[error("not a stasis manifest (bad magic)")]
    BadMagic,
    #[error("manifest is truncated: {got} bytes, expected {expected}")]
    Truncated { got: usize, expected: u64 },
    #[error(
        "manifest format {major}.{minor} is not supported (this stasisd reads {MAJOR}.0 to {MAJOR}.{MINOR})"
    )]
    UnsupportedVersion { major: u16, minor: u16 },
    #[error("manifest uses format flags {0:#x} this stasisd does not know")]
    UnknownFlags(u32),
    #[error("manifest payload of {0} bytes exceeds the limit")]
    TooLarge(u64),
    #[error("manifest checksum mismatch: the object is corrupted")]
    ChecksumMismatch,
    #[error("manifest payload does not decode: {0}")]
    Decode(String),
}

/// Frames `manifest` for storage.
pub fn encode(manifest: &Manifest) -> Vec<u8> {
    let payload = manifest.encode_to_vec();
    let mut out = Vec::with_capacity(HEADER_LEN + payload.len());
    out.extend_from_slice(MAGIC);
    out.extend_from_slice(&MAJOR.to_le_bytes());
    out.extend_from_slice(&MINOR.to_le_bytes());
    out.extend_from_slice(&0u32.to_le_bytes());
    out.extend_from_slice(&(payload.len() as u64).to_le_bytes());
    out.extend_from_slice(blake3::hash(&payload).as_bytes());
    out.extend_from_slice(&payload);
    out
}

/// Checks the frame and decodes the manifest inside it.
pub fn decode(data: &[u8]) -> Result<Manifest, ManifestError> {
    if data.len() < HEADER_LEN {
        return if data.len() >= MAGIC.len() && &data[..8] != MAGIC {
            Err(ManifestError::BadMagic)
        } else {
            Err(ManifestError::Truncated { got: data.len(), expected: HEADER_LEN as u64 })
        };
    }
    if &data[..8] != MAGIC {
        return Err(ManifestError::BadMagic);
    }
    let le16 = |at: usize| u16::from_le_bytes([data[at], data[at + 1]]);
    let (major, minor) = (le16(8), le16(10));
    if major != MAJOR || minor > MINOR {
        return Err(ManifestError::UnsupportedVersion { major, minor });
    }
    let flags = u32::from_le_bytes(data[12..16].try_into().expect("4-byte slice"));
    if flags != 0 {
        return Err(ManifestError::UnknownFlags(flags));
    }
    let len = u64::from_le_bytes(data[16..24].try_into().expect("8-byte slice"));
    if len > MAX_PAYLOAD {
        return Err(ManifestError::TooLarge(len));
    }
    let payload = &data[HEADER_LEN..];
    if payload.len() as u64 != len {
        return Err(ManifestError::Truncated { got: data.len(), expected: HEADER_LEN as u64 + len });
    }
    if blake3::hash(payload).as_bytes() != &data[24..56] {
        return Err(ManifestError::ChecksumMismatch);
    }
    Manifest::decode(payload).map_err(|e| ManifestError::Decode(e.to_string()))
}

#[cfg(test)]
mod tests {
    use super::*;

    fn sample() -> Manifest {
        Manifest {
            id: "20261122-101010-abcdef".into(),
            workload: "w".into(),
            root_pid: 7,
            ..Default::default()
        }
    }

    #[test]
    fn round_trip() {
        assert_eq!(decode(&encode(&sample())).unwrap(), sample());
    }

    #[test]
    fn every_flipped_byte_is_detected() {
        let good = encode(&sample());
        for i in 0..good.len() {
            let mut bad = good.clone();
            bad[i] ^= 0x01;
            assert!(decode(&bad).is_err(), "flip at byte {i} went unnoticed");
        }
    }

    #[test]
    fn truncation_and_versions_are_reported() {
        let good = encode(&sample());
        assert!(matches!(decode(&good[..good.len() - 1]), Err(ManifestError::Truncated { .. })));
        assert!(matches!(decode(&good[..10]), Err(ManifestError::Truncated { .. })));
        let mut newer = good.clone();
        newer[10] = 9;
        assert_eq!(decode(&newer), Err(ManifestError::UnsupportedVersion { major: 1, minor: 9 }));
        assert_eq!(
            decode(b"NOTAMANIFEST-at-all-but-long-enough-to-have-a-full-header-here"),
            Err(ManifestError::BadMagic)
        );
    }
}
