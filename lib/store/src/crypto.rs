//! Encryption at rest: with a key configured, every object stasis writes to the store (pack
//! chunks, pack indexes, manifests) is sealed with XChaCha20-Poly1305, and chunk ids are keyed
//! BLAKE3 hashes, so the bucket reveals neither content nor which chunks are equal (across
//! stores with different keys, or to anyone without the key).
//!
//! Keys: the user's key (32 bytes, hex in a file or the environment) wraps a random data key,
//! stored sealed in the store's `keys` object. Data and chunk ids derive from the data key, so
//! rotating the user's key only re-wraps the data key (`--rotate-store-key-from OLD`); every
//! checkpoint stays readable and deduplication goes on.
//!
//! ```text
//! sealed blob = nonce (24 random bytes) || ciphertext || tag (16)   AAD: what the blob is
//! keys object = "STASISKY" || version (u16 LE) || sealed data key    sealed with the user key
//! ```

use std::path::Path;

use chacha20poly1305::aead::{Aead, KeyInit, Payload};
use chacha20poly1305::{XChaCha20Poly1305, XNonce};

use super::index::ChunkHash;

/// The store object holding the wrapped data key.
pub const KEYS_OBJECT: &str = "keys";

const NONCE: usize = 24;
const TAG: usize = 16;
const KEYS_MAGIC: &[u8; 8] = b"STASISKY";
const KEYS_VERSION: u16 = 1;

/// Bytes sealing adds to what it seals.
pub const OVERHEAD: usize = NONCE + TAG;

/// A key could not be read, or does not open the store.
#[derive(Debug, thiserror::Error)]
pub enum KeyError {
    #[error("cannot read the store key file {path}")]
    Read {
        path: String,
        #[source]
        source: std::io::Error,
    },
    #[error("a store key is 64 hex digits (32 bytes; e.g. from `openssl rand -hex 32`)")]
    Malformed,
    #[error("the store key does not open this store's keys: it is the wrong key")]
    WrongKey,
    #[error("the store's keys object is damaged: {0}")]
    Damaged(&'static str),
}

/// The user's key, which wraps the store's data key.
#[derive(Clone, PartialEq, Eq)]
pub struct StoreKey([u8; 32]);

impl std::fmt::Debug for StoreKey {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str("StoreKey(..)")
    }
}

impl StoreKey {
    pub fn from_hex(text: &str) -> Result<StoreKey, KeyError> {
        let bytes = hex::decode(text.trim()).map_err(|_| KeyError::Malformed)?;
        Ok(StoreKey(bytes.try_into().map_err(|_| KeyError::Malformed)?))
    }

    pub fn read_file(path: &Path) -> Result<StoreKey, KeyError> {
        let text = std::fs::read_to_string(path)
            .map_err(|source| KeyError::Read { path: path.display().to_string(), source })?;
        StoreKey::from_hex(&text)
    }

    fn aead(&self) -> XChaCha20Poly1305 {
        XChaCha20Poly1305::new((&blake3::derive_key("stasis 2026-11 store key wrapping", &self.0)).into())
    }

    /// A new random data key, wrapped: the content of a fresh `keys` object.
    pub fn new_keys_object(&self) -> (Vec<u8>, Cipher) {
        let data_key: [u8; 32] = rand::random();
        (self.wrap(&data_key), Cipher::new(&data_key))
    }

    /// The `keys` object holding `data_key` sealed with this key.
    fn wrap(&self, data_key: &[u8; 32]) -> Vec<u8> {
        let mut out = KEYS_MAGIC.to_vec();
        out.extend(KEYS_VERSION.to_le_bytes());
        out.extend(seal(&self.aead(), KEYS_MAGIC, data_key));
        out
    }

    /// The store's cipher, from its `keys` object.
    pub fn open_keys(&self, object: &[u8]) -> Result<Cipher, KeyError> {
        Ok(Cipher::new(&self.unwrap(object)?))
    }

    fn unwrap(&self, object: &[u8]) -> Result<[u8; 32], KeyError> {
        let body = object.strip_prefix(KEYS_MAGIC).ok_or(KeyError::Damaged("bad magic"))?;
        let (version, sealed) = body.split_at_checked(2).ok_or(KeyError::Damaged("truncated"))?;
        if version != KEYS_VERSION.to_le_bytes() {
            return Err(KeyError::Damaged("unknown version"));
        }
        let key = open(&self.aead(), KEYS_MAGIC, sealed).ok_or(KeyError::WrongKey)?;
        key.try_into().map_err(|_| KeyError::Damaged("the data key has the wrong size"))
    }

    /// The `keys` object re-wrapped under `new`, for rotating the user's key.
    pub fn rewrap(&self, object: &[u8], new: &StoreKey) -> Result<Vec<u8>, KeyError> {
        Ok(new.wrap(&self.unwrap(object)?))
    }
}

/// Seals and opens a store's objects, and names its chunks.
pub struct Cipher {
    aead: XChaCha20Poly1305,
    id_key: [u8; 32],
}

impl std::fmt::Debug for Cipher {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str("Cipher(..)")
    }
}

impl Cipher {
    fn new(data_key: &[u8; 32]) -> Cipher {
        let aead =
            XChaCha20Poly1305::new((&blake3::derive_key("stasis 2026-11 store data", data_key)).into());
        Cipher { aead, id_key: blake3::derive_key("stasis 2026-11 chunk ids", data_key) }
    }

    /// `plain` sealed, bound to `what` (the object's kind, or a chunk's id).
    pub fn seal(&self, what: &[u8], plain: &[u8]) -> Vec<u8> {
        seal(&self.aead, what, plain)
    }

    /// What `sealed` holds, if it is intact and was sealed as `what` under this store's key.
    pub fn open(&self, what: &[u8], sealed: &[u8]) -> Option<Vec<u8>> {
        open(&self.aead, what, sealed)
    }
}

/// The id of a chunk of `data`: its BLAKE3 hash, keyed in an encrypted store.
pub fn chunk_id(cipher: Option<&Cipher>, data: &[u8]) -> ChunkHash {
    match cipher {
        Some(c) => *blake3::keyed_hash(&c.id_key, data).as_bytes(),
        None => *blake3::hash(data).as_bytes(),
    }
}

fn seal(aead: &XChaCha20Poly1305, what: &[u8], plain: &[u8]) -> Vec<u8> {
    let nonce: [u8; NONCE] = rand::random();
    let sealed = aead
        .encrypt(XNonce::from_slice(&nonce), Payload { msg: plain, aad: what })
        .expect("XChaCha20-Poly1305 seals any length a store object has");
    let mut out = Vec::with_capacity(NONCE + sealed.len());
    out.extend_from_slice(&nonce);
    out.extend(sealed);
    out
}

fn open(aead: &XChaCha20Poly1305, what: &[u8], sealed: &[u8]) -> Option<Vec<u8>> {
    let (nonce, body) = sealed.split_at_checked(NONCE)?;
    aead.decrypt(XNonce::from_slice(nonce), Payload { msg: body, aad: what }).ok()
}

#[cfg(test)]
mod tests {
    use super::*;

    fn key(byte: u8) -> StoreKey {
        StoreKey::from_hex(&hex::encode([byte; 32])).unwrap()
    }

    #[test]
    fn sealed_objects_open_only_intact_with_the_key_and_for_what_they_were_sealed() {
        let (object, cipher) = key(1).new_keys_object();
        let sealed = cipher.seal(b"manifest", b"secret memory");
        assert_eq!(sealed.len(), b"secret memory".len() + OVERHEAD);
        assert!(!sealed.windows(6).any(|w| w == b"secret"));
        assert_eq!(cipher.open(b"manifest", &sealed).as_deref(), Some(&b"secret memory"[..]));
        assert!(cipher.open(b"index", &sealed).is_none(), "bound to its kind");
        let mut flipped = sealed.clone();
        flipped[30] ^= 1;
        assert!(cipher.open(b"manifest", &flipped).is_none(), "damage is detected");
        let reopened = key(1).open_keys(&object).unwrap();
        assert_eq!(reopened.open(b"manifest", &sealed).as_deref(), Some(&b"secret memory"[..]));
        assert!(matches!(key(2).open_keys(&object), Err(KeyError::WrongKey)));
    }

    #[test]
    fn chunk_ids_are_keyed_and_rotation_keeps_them() {
        let (object, cipher) = key(1).new_keys_object();
        let (_, other) = key(1).new_keys_object();
        let data = b"the same memory";
        assert_ne!(chunk_id(Some(&cipher), data), chunk_id(None, data));
        assert_ne!(chunk_id(Some(&cipher), data), chunk_id(Some(&other), data), "another store, other ids");
        let rotated = key(1).rewrap(&object, &key(3)).unwrap();
        let after = key(3).open_keys(&rotated).unwrap();
        assert_eq!(chunk_id(Some(&after), data), chunk_id(Some(&cipher), data), "dedup survives rotation");
        assert!(key(1).open_keys(&rotated).is_err(), "the old key no longer opens it");
    }

    #[test]
    fn malformed_keys_are_refused() {
        assert!(matches!(StoreKey::from_hex("abc"), Err(KeyError::Malformed)));
        assert!(matches!(StoreKey::from_hex(&"zz".repeat(32)), Err(KeyError::Malformed)));
        assert!(StoreKey::from_hex(&format!("{}\n", "ab".repeat(32))).is_ok());
    }
}
