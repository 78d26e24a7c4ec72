//! How a chunk's bytes are encoded in a pack: as they are, with zstd, or with lz4.
//!
//! A store's writers compress the chunks they write as one [`Compression`] says; a reader
//! decodes each chunk as its index entry names it, so one store may hold chunks of both (its
//! compression changed between checkpoints), and a checkpoint restores whatever wrote it.

use std::borrow::Cow;
use std::fmt;

use stasis_proto::stasis::store::v1::Codec;

use super::chunks::CHUNK;

/// zstd level: fast, and on memory images close to higher levels in ratio.
const ZSTD_LEVEL: i32 = 1;

/// How new chunks are compressed.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub enum Compression {
    /// zstd at level 1: the smaller store and the shorter upload.
    #[default]
    Zstd,
    /// lz4: restores decompress it a few times faster than zstd, for more stored bytes (on
    /// text-like memory about half as many again): for jobs whose restore time matters more
    /// than the store's size and the upload's length.
    Lz4,
}

impl fmt::Display for Compression {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(match self {
            Compression::Zstd => "zstd",
            Compression::Lz4 => "lz4",
        })
    }
}

/// A codec's name, as reports give it ("raw" for a chunk kept as it is; the others as the
/// [`Compression`] that writes them).
pub(super) fn name(codec: Codec) -> &'static str {
    match codec {
        Codec::Raw => "raw",
        Codec::Zstd => "zstd",
        Codec::Lz4 => "lz4",
    }
}

/// `raw` compressed as `compression` says, with the codec that names it, where that saves at
/// least 1/32 of its bytes; `None` where it does not (the chunk is then kept as it is).
pub(super) fn encode(compression: Compression, raw: &[u8]) -> Option<(Codec, Vec<u8>)> {
    let (codec, bytes) = match compression {
        Compression::Zstd => (Codec::Zstd, zstd_compress(raw).ok()?),
        Compression::Lz4 => (Codec::Lz4, lz4_flex::block::compress(raw)),
    };
    (bytes.len() < raw.len() - raw.len() / 32).then_some((codec, bytes))
}

/// `stored` decoded as `codec` says, `len` bytes long; the error says why not. A chunk kept as
/// it is is `stored` itself.
pub(super) fn decode(codec: Codec, stored: Cow<'_, [u8]>, len: usize) -> Result<Cow<'_, [u8]>, &'static str> {
    if len > CHUNK {
        // Before a buffer of that size is made: the length comes from the pack's index.
        return Err("its index gives it a length over the chunk size");
    }
    let data = match codec {
        Codec::Raw => stored,
        Codec::Zstd => Cow::Owned(zstd_decompress(&stored, len).map_err(|_| "it does not decompress")?),
        Codec::Lz4 => {
            Cow::Owned(lz4_flex::block::decompress(&stored, len).map_err(|_| "it does not decompress")?)
        }
    };
    if data.len() != len {
        return Err("it is not as long as its index says");
    }
    Ok(data)
}

thread_local! {
    /// Each thread's compression context: making one per chunk allocated and freed a large
    /// buffer every 64 KiB, page faults included.
    static COMPRESSOR: std::cell::RefCell<Option<zstd::bulk::Compressor<'static>>> =
        const { std::cell::RefCell::new(None) };
    /// Each thread's decompression context, kept rather than made for every chunk.
    static DECOMPRESSOR: std::cell::RefCell<Option<zstd::bulk::Decompressor<'static>>> =
        const { std::cell::RefCell::new(None) };
}

/// `raw` compressed with zstd at [`ZSTD_LEVEL`].
fn zstd_compress(raw: &[u8]) -> std::io::Result<Vec<u8>> {
    COMPRESSOR.with_borrow_mut(|compressor| {
        let compressor = match compressor {
            Some(c) => c,
            None => compressor.insert(zstd::bulk::Compressor::new(ZSTD_LEVEL)?),
        };
        compressor.compress(raw)
    })
}

/// `stored` decompressed with zstd, at most `len` bytes.
fn zstd_decompress(stored: &[u8], len: usize) -> std::io::Result<Vec<u8>> {
    DECOMPRESSOR.with_borrow_mut(|decompressor| {
        let decompressor = match decompressor {
            Some(d) => d,
            None => decompressor.insert(zstd::bulk::Decompressor::new()?),
        };
        decompressor.decompress(stored, len)
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Text-like bytes (compressible) followed by pseudo-random ones (not).
    fn sample() -> (Vec<u8>, Vec<u8>) {
        let text: Vec<u8> =
            b"the quick brown fox jumps over the lazy dog; ".iter().copied().cycle().take(65536).collect();
        let mut x = 0x9e37_79b9_7f4a_7c15u64;
        let random = (0..65536)
            .map(|_| {
                x ^= x << 13;
                x ^= x >> 7;
                x ^= x << 17;
                x as u8
            })
            .collect();
        (text, random)
    }

    #[test]
    fn each_compression_round_trips_and_keeps_what_it_cannot_shrink_as_it_is() {
        let (text, random) = sample();
        for compression in [Compression::Zstd, Compression::Lz4] {
            let (codec, stored) = encode(compression, &text).expect("text compresses");
            assert_eq!(codec, if compression == Compression::Zstd { Codec::Zstd } else { Codec::Lz4 });
            assert!(stored.len() < text.len() / 4, "{compression}: {} bytes", stored.len());
            assert_eq!(decode(codec, Cow::Borrowed(&stored), text.len()).unwrap().as_ref(), text.as_slice());
            assert!(encode(compression, &random).is_none(), "{compression}: random bytes kept as they are");
        }
    }

    #[test]
    fn a_damaged_or_misdescribed_chunk_is_an_error_for_each_codec() {
        let (text, _) = sample();
        for compression in [Compression::Zstd, Compression::Lz4] {
            let (codec, stored) = encode(compression, &text).unwrap();
            let short = decode(codec, Cow::Borrowed(&stored), text.len() - 1);
            let long = decode(codec, Cow::Borrowed(&stored), text.len() + 1);
            let cut = decode(codec, Cow::Borrowed(&stored[..stored.len() / 2]), text.len());
            for (what, r) in [("short", short), ("long", long), ("cut", cut)] {
                assert!(r.is_err(), "{compression}: a {what} chunk decoded");
            }
        }
        assert_eq!(decode(Codec::Raw, Cow::Borrowed(&text), 3), Err("it is not as long as its index says"));
        let huge = decode(Codec::Lz4, Cow::Borrowed(&text), u32::MAX as usize);
        assert_eq!(huge, Err("its index gives it a length over the chunk size"));
    }

    #[test]
    fn every_damaged_byte_of_a_compressed_chunk_is_an_error_or_other_content_never_a_panic() {
        let (text, _) = sample();
        for compression in [Compression::Zstd, Compression::Lz4] {
            let (codec, stored) = encode(compression, &text).unwrap();
            let (mut flips, mut changed) = (0, 0);
            for at in 0..stored.len() {
                for bit in [0x01, 0x80] {
                    let mut damaged = stored.clone();
                    damaged[at] ^= bit;
                    flips += 1;
                    match decode(codec, Cow::Borrowed(&damaged), text.len()) {
                        Err(_) => changed += 1,
                        Ok(data) => changed += usize::from(data.as_ref() != text.as_slice()),
                    }
                }
            }
            // Most damage shows in the result: what the checksum and the id then catch.
            assert!(changed * 2 > flips, "{compression}: {changed} of {flips} flips showed");
        }
    }
}
