//! How a fetched chunk is checked: by the checksum of its stored bytes its index records, or by
//! its content where the index (written before checksums) records none; a full check by both.

use stasis_proto::stasis::store::v1::Codec;
use tokio::sync::mpsc;

use super::{Verify, decode_chunk};
use crate::chunks::{CHUNK, ChunkWriter};
use crate::codec::Compression;
use crate::crypto::{Cipher, StoreKey};
use crate::index::{ChunkHash, ChunkIndex, ChunkLoc};
use crate::pack_slots::PackSlots;

/// Compressible content, then random content, a chunk each.
fn contents() -> [Vec<u8>; 2] {
    let text = b"the quick brown fox ".repeat(CHUNK / 20 + 1)[..CHUNK].to_vec();
    let mut random = vec![0u8; CHUNK];
    blake3::Hasher::new().update(b"decode").finalize_xof().fill(&mut random);
    [text, random]
}

/// [`contents`] packed by the store's own writer, compressing as `compression` says: the
/// pack's bytes, and each chunk's id and place in it.
fn packed(cipher: Option<&Cipher>, compression: Compression) -> (Vec<u8>, Vec<(ChunkHash, ChunkLoc)>) {
    let (index, (tx, mut rx)) = (ChunkIndex::default(), mpsc::channel(4));
    let mut writer = ChunkWriter::new(&index, tx, "t", cipher, PackSlots::default()).compressing(compression);
    let [text, random] = contents();
    writer.write(&[&text, &random]).unwrap();
    writer.flush().unwrap();
    let pack = rx.try_recv().unwrap();
    let name = pack.index.pack.as_str().into();
    let chunks = pack.index.entries.iter().map(|e| ChunkLoc::of(&name, e).unwrap()).collect();
    (pack.data, chunks)
}

fn blob<'a>(data: &'a [u8], loc: &ChunkLoc) -> &'a [u8] {
    &data[loc.offset as usize..(loc.offset + u64::from(loc.stored_len)) as usize]
}

fn cipher() -> Cipher {
    StoreKey::from_hex(&"3c".repeat(32)).unwrap().new_keys_object().1
}

#[test]
fn chunks_read_back_as_written_and_any_flipped_byte_is_found() {
    let key = cipher();
    let each = [(Compression::Zstd, Codec::Zstd), (Compression::Lz4, Codec::Lz4)];
    for ((compression, codec), cipher) in each.into_iter().flat_map(|c| [(c, None), (c, Some(&key))]) {
        let (data, chunks) = packed(cipher, compression);
        let [(text_id, text), (random_id, random)] = &chunks[..] else { panic!("two chunks") };
        assert_eq!((text.codec, random.codec), (codec, Codec::Raw));
        assert!(text.stored_checksum.is_some() && random.stored_checksum.is_some());
        for ((id, loc), content) in [(text_id, text), (random_id, random)].into_iter().zip(contents()) {
            for verify in [Verify::Stored, Verify::Everything] {
                let read = decode_chunk(blob(&data, loc), loc, id, cipher, verify).unwrap();
                assert_eq!(*read, content[..], "{verify:?}");
                for at in [0, 7, loc.stored_len as usize / 2, loc.stored_len as usize - 1] {
                    let mut damaged = blob(&data, loc).to_vec();
                    damaged[at] ^= 0x10;
                    let found = decode_chunk(&damaged, loc, id, cipher, verify);
                    assert_eq!(
                        found.unwrap_err(),
                        "its stored bytes do not match the checksum its index records",
                        "byte {at} of {verify:?}, encrypted {}",
                        cipher.is_some()
                    );
                }
            }
        }
    }
}

#[test]
fn a_chunk_indexed_without_a_checksum_is_checked_by_its_content() {
    for compression in [Compression::Zstd, Compression::Lz4] {
        let (data, chunks) = packed(None, compression);
        let (id, mut loc) = chunks[0].clone();
        loc.stored_checksum = None;
        assert_eq!(
            *decode_chunk(blob(&data, &loc), &loc, &id, None, Verify::Stored).unwrap(),
            contents()[0][..]
        );
        // A flip in a literal decompresses to other content: only the content's hash finds it.
        let stored = blob(&data, &loc);
        let literal = stored.windows(5).position(|w| w == b"quick").expect("a literal run");
        let mut damaged = stored.to_vec();
        damaged[literal] ^= 0x01;
        let found = decode_chunk(&damaged, &loc, &id, None, Verify::Stored).unwrap_err();
        assert_eq!(found, "its content does not match its hash", "{compression}");
    }
}

#[test]
fn a_chunk_stored_under_another_id_is_found_by_the_full_check() {
    // A writer's error: the stored bytes agree with their checksum, not with the id.
    for compression in [Compression::Zstd, Compression::Lz4] {
        let (data, chunks) = packed(None, compression);
        let (_, loc) = &chunks[0];
        let wrong_id = [9u8; 32];
        let found = decode_chunk(blob(&data, loc), loc, &wrong_id, None, Verify::Everything).unwrap_err();
        assert_eq!(found, "its content does not match its hash", "{compression}");
    }
}
