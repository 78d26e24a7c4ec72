//! Turning content into chunk references: cut, hash, drop zero chunks, skip chunks the store
//! already has, compress and pack the new ones.
//!
//! This runs on a blocking thread (hashing and compression in parallel with rayon); finished
//! packs go to the async uploader through a bounded channel, which bounds the memory held in
//! packs waiting for upload.

use std::borrow::Cow;
use std::collections::HashSet;

use rayon::prelude::*;
use stasis_proto::stasis::store::v1::{ChunkRef, Codec, PackEntry, PackIndex};
use tokio::sync::mpsc;

use super::codec::{self, Compression};
use super::crypto::{Cipher, chunk_id};
use super::index::{ChunkHash, ChunkIndex, StoredChecksum, stored_checksum};
use super::pack_slots::{PackSlot, PackSlots};

/// Chunk size: content is cut at multiples of this (addresses for memory, offsets for files).
pub const CHUNK: usize = 64 << 10;
/// Packs are uploaded once they reach this size.
pub const PACK_TARGET: usize = 32 << 20;
/// Bytes a pack's buffer has room for: the chunk that takes a pack past [`PACK_TARGET`] ends
/// it, and a sealed chunk is a little longer than [`CHUNK`].
const PACK_ROOM: usize = PACK_TARGET + 2 * CHUNK;
/// Chunks handled per parallel batch.
const BATCH: usize = 256;

/// Counts of one checkpoint's chunks.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct ChunkStats {
    /// Bytes of all chunks, zero ones included.
    pub bytes_total: u64,
    pub chunks_total: u64,
    pub chunks_new: u64,
    pub chunks_zero: u64,
    /// Bytes of new chunks before compression.
    pub bytes_new: u64,
    /// Bytes of memory CRIU did not read again, unchanged since the previous checkpoint of
    /// the tree (dirty-page tracking), and taken from it.
    pub bytes_unchanged: u64,
    /// Of those, bytes sharing a chunk with written pages that were read from the stopped tree
    /// rather than from the previous checkpoint (`tree_pages.rs`).
    pub bytes_from_tree: u64,
    /// Of those, bytes referenced as a part of a chunk of the previous checkpoint (unchanged
    /// pages beside written ones, or of a mapping that changed shape: `ParentMemory::references`).
    pub bytes_in_part: u64,
}

/// A pack ready for upload.
#[derive(Debug)]
pub struct FinishedPack {
    pub data: Vec<u8>,
    pub index: PackIndex,
    /// Its place among the packs in memory, and where its buffer goes after the upload;
    /// none for a pack outside them (a collection's repack).
    pub slot: Option<PackSlot>,
}

/// Cuts the bytes of `pieces`, which follow each other from address (or offset) `start` on,
/// at multiples of [`CHUNK`]: each chunk is the part of one aligned window that the bytes
/// cover, wherever the pieces themselves end. A window within one piece is borrowed; one that
/// spans pieces is copied.
pub fn aligned_windows<'a>(start: u64, pieces: &[&'a [u8]]) -> Vec<Cow<'a, [u8]>> {
    let mut cutter = WindowCutter::new(start);
    let mut windows: Vec<Cow<'a, [u8]>> = pieces.iter().flat_map(|piece| cutter.cut(piece)).collect();
    windows.extend(cutter.finish().map(Cow::Owned));
    windows
}

/// [`aligned_windows`] a piece at a time, for bytes that arrive while earlier ones are being
/// stored: the part of a window that the pieces so far cover is kept until the next piece
/// completes it, or [`WindowCutter::finish`] ends the stretch.
#[derive(Debug)]
pub struct WindowCutter {
    /// Address (or offset) of the next byte.
    addr: u64,
    /// The covered part of a window that the next piece may complete.
    partial: Vec<u8>,
}

impl WindowCutter {
    pub fn new(start: u64) -> Self {
        Self { addr: start, partial: Vec::new() }
    }

    /// The windows `piece` completes, in order.
    pub fn cut<'a>(&mut self, piece: &'a [u8]) -> Vec<Cow<'a, [u8]>> {
        let mut windows = Vec::with_capacity(piece.len() / CHUNK + 2);
        let mut pos = 0usize;
        while pos < piece.len() {
            let to_boundary = (CHUNK as u64 - self.addr % CHUNK as u64) as usize;
            let end = (pos + to_boundary).min(piece.len());
            let part = &piece[pos..end];
            let window_done = end - pos == to_boundary;
            if !self.partial.is_empty() {
                // Room for the rest of the window once a second piece comes: growing it piece
                // by piece would copy the bytes so far each time (a write among unchanged
                // pages makes such a window per write). Not before: every image's last window
                // may wait, begun, until the dump ends, and is often one page.
                self.partial.reserve_exact(to_boundary);
            }
            match (self.partial.is_empty(), window_done) {
                (true, true) => windows.push(Cow::Borrowed(part)),
                (_, false) => self.partial.extend_from_slice(part),
                (false, true) => {
                    self.partial.extend_from_slice(part);
                    windows.push(Cow::Owned(std::mem::take(&mut self.partial)));
                }
            }
            self.addr += part.len() as u64;
            pos = end;
        }
        windows
    }

    /// Address (or offset) of the next byte.
    pub fn addr(&self) -> u64 {
        self.addr
    }

    /// Address (or offset) of the first byte of the window the next piece continues: of the
    /// begun window, or the next byte.
    pub fn window_start(&self) -> u64 {
        self.addr - self.partial.len() as u64
    }

    /// Whether a window is begun: bytes of it wait for the rest.
    pub fn within_window(&self) -> bool {
        !self.partial.is_empty()
    }

    /// Ends a chunk here, inside a window: the covered part of the begun window, if any
    /// (pages of one kind that the window's other pages, referenced elsewhere, do not join).
    pub fn end_piece(&mut self) -> Option<Vec<u8>> {
        (!self.partial.is_empty()).then(|| std::mem::take(&mut self.partial))
    }

    /// Passes over `len` bytes chunked elsewhere, which end a chunk.
    pub fn skip(&mut self, len: u64) {
        debug_assert!(self.partial.is_empty(), "bytes of a window wait");
        self.addr += len;
    }

    /// The last window's covered part, if the stretch ended inside a window.
    pub fn finish(self) -> Option<Vec<u8>> {
        (!self.partial.is_empty()).then_some(self.partial)
    }
}

/// What a chunk of content is to the store.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(super) enum Kind {
    /// All zero: recorded, never stored.
    Zero,
    /// Held by the store already.
    Held(ChunkHash),
    /// Lacking from the store.
    New(ChunkHash),
}

impl Kind {
    /// Hashes `raw` and asks `index` whether the store holds it.
    pub(super) fn of(cipher: Option<&Cipher>, index: &ChunkIndex, raw: &[u8]) -> Kind {
        if is_zero(raw) {
            return Kind::Zero;
        }
        let hash = chunk_id(cipher, raw);
        if index.contains(&hash) { Kind::Held(hash) } else { Kind::New(hash) }
    }

    /// The reference to a chunk of `len` bytes of this kind.
    pub(super) fn reference(&self, len: usize) -> ChunkRef {
        let (hash, fresh) = match self {
            Kind::Zero => (Vec::new(), false),
            Kind::Held(hash) => (hash.to_vec(), false),
            Kind::New(hash) => (hash.to_vec(), true),
        };
        ChunkRef { hash, len: len as u32, fresh, offset: 0 }
    }
}

impl ChunkStats {
    /// Counts a chunk referenced as an earlier checkpoint has it (held, or zero).
    pub(super) fn count_known(&mut self, chunk: &ChunkRef) {
        self.chunks_total += 1;
        self.bytes_total += u64::from(chunk.len);
        if chunk.hash.is_empty() {
            self.chunks_zero += 1;
        }
    }

    /// Counts a chunk of `len` bytes of `kind`; `first` for a new chunk the checkpoint has not
    /// met before (a chunk recurring in it is packed once).
    pub(super) fn count(&mut self, len: usize, kind: &Kind, first: bool) {
        self.chunks_total += 1;
        self.bytes_total += len as u64;
        match kind {
            Kind::Zero => self.chunks_zero += 1,
            Kind::New(_) if first => {
                self.chunks_new += 1;
                self.bytes_new += len as u64;
            }
            Kind::New(_) | Kind::Held(_) => {}
        }
    }
}

/// A chunk as a pack keeps it: how it is encoded, its bytes (the chunk's own where they are
/// kept as they are), and their checksum.
struct Stored<'a> {
    codec: Codec,
    bytes: Cow<'a, [u8]>,
    checksum: StoredChecksum,
}

/// How chunk `raw` (id `hash`) is kept in a pack: compressed as `compression` says where that
/// saves at least 1/32, sealed in an encrypted store, with the checksum a restore checks it by.
fn stored_form<'a>(
    cipher: Option<&Cipher>,
    compression: Compression,
    hash: &ChunkHash,
    raw: &'a [u8],
) -> Stored<'a> {
    let (codec, stored) = match codec::encode(compression, raw) {
        Some((codec, bytes)) => (codec, Cow::Owned(bytes)),
        None => (Codec::Raw, Cow::Borrowed(raw)),
    };
    let bytes = match cipher {
        Some(c) => Cow::Owned(c.seal(hash, &stored)),
        None => stored,
    };
    let checksum = stored_checksum(&bytes);
    Stored { codec, bytes, checksum }
}

fn is_zero(data: &[u8]) -> bool {
    let words = data.chunks_exact(8);
    let rest = words.remainder();
    rest.iter().all(|b| *b == 0)
        && words.map(|w| u64::from_ne_bytes(w.try_into().expect("8 bytes"))).all(|w| w == 0)
}

/// Writes chunks for one checkpoint.
pub struct ChunkWriter<'a> {
    index: &'a ChunkIndex,
    /// An encrypted store's cipher: keyed chunk ids, sealed chunks.
    cipher: Option<&'a Cipher>,
    /// How new chunks are compressed.
    compression: Compression,
    /// New chunks already packed by this checkpoint.
    packed: HashSet<ChunkHash>,
    pack: Option<FinishedPack>,
    packs: mpsc::Sender<FinishedPack>,
    /// Places for packs in memory, shared by the store's writers.
    slots: PackSlots,
    node_tag: &'a str,
    pub stats: ChunkStats,
}

impl<'a> ChunkWriter<'a> {
    /// Packs get ids starting with `node_tag`, so a node can tell its own leftovers.
    pub fn new(
        index: &'a ChunkIndex,
        packs: mpsc::Sender<FinishedPack>,
        node_tag: &'a str,
        cipher: Option<&'a Cipher>,
        slots: PackSlots,
    ) -> Self {
        let stats = ChunkStats::default();
        let compression = Compression::default();
        Self { index, cipher, compression, packed: HashSet::new(), pack: None, packs, slots, node_tag, stats }
    }

    /// Compresses new chunks as `compression` says (zstd by default).
    pub fn compressing(self, compression: Compression) -> Self {
        Self { compression, ..self }
    }

    /// Stores `pieces` (each at most [`CHUNK`] bytes) and returns their references in order.
    /// Fails only when the uploader has gone away (its error is reported there).
    pub fn write(&mut self, pieces: &[&[u8]]) -> Result<Vec<ChunkRef>, UploaderGone> {
        let mut refs = Vec::with_capacity(pieces.len());
        for batch in pieces.chunks(BATCH) {
            // Hashing, and compressing what the store lacks, in one parallel pass.
            let (cipher, index, compression) = (self.cipher, self.index, self.compression);
            let prepared: Vec<(Kind, Option<Stored>)> = batch
                .par_iter()
                .map(|raw| {
                    let kind = Kind::of(cipher, index, raw);
                    let stored = match &kind {
                        Kind::New(hash) => Some(stored_form(cipher, compression, hash, raw)),
                        Kind::Zero | Kind::Held(_) => None,
                    };
                    (kind, stored)
                })
                .collect();
            for (raw, (kind, stored)) in batch.iter().zip(prepared) {
                refs.push(kind.reference(raw.len()));
                // Packed once per checkpoint, however often the same bytes recur in it.
                let first = match (kind, stored) {
                    (Kind::New(hash), Some(stored)) if self.packed.insert(hash) => {
                        self.append(hash, raw.len(), &stored)?;
                        true
                    }
                    _ => false,
                };
                self.stats.count(raw.len(), &kind, first);
            }
        }
        Ok(refs)
    }

    /// Packs chunks already hashed and found lacking from the store (a sifted dump's new
    /// chunks, counted when they were sifted), compressing them in parallel.
    pub(super) fn write_new(&mut self, chunks: &[(ChunkHash, &[u8])]) -> Result<(), UploaderGone> {
        for batch in chunks.chunks(BATCH) {
            let (cipher, compression) = (self.cipher, self.compression);
            let stored: Vec<Stored> =
                batch.par_iter().map(|(hash, raw)| stored_form(cipher, compression, hash, raw)).collect();
            for ((hash, raw), stored) in batch.iter().zip(stored) {
                if self.packed.insert(*hash) {
                    self.append(*hash, raw.len(), &stored)?;
                }
            }
        }
        Ok(())
    }

    fn append(&mut self, hash: ChunkHash, len: usize, stored: &Stored) -> Result<(), UploaderGone> {
        if self.pack.is_none() {
            // Waits while other checkpoints' packs fill the places (their uploads free them).
            let (slot, data) = futures::executor::block_on(self.slots.take(PACK_ROOM));
            self.pack = Some(FinishedPack {
                data,
                index: PackIndex { pack: new_pack_id(self.node_tag), entries: Vec::new() },
                slot: Some(slot),
            });
        }
        let pack = self.pack.as_mut().expect("a pack was just made");
        pack.index.entries.push(PackEntry {
            hash: hash.to_vec(),
            offset: pack.data.len() as u64,
            stored_len: stored.bytes.len() as u32,
            len: len as u32,
            codec: stored.codec as i32,
            stored_checksum: stored.checksum.to_vec(),
        });
        pack.data.extend_from_slice(&stored.bytes);
        if pack.data.len() >= PACK_TARGET {
            self.flush()?;
        }
        Ok(())
    }

    /// Sends the current pack, if any, to the uploader.
    pub fn flush(&mut self) -> Result<(), UploaderGone> {
        match self.pack.take() {
            Some(pack) => self.packs.blocking_send(pack).map_err(|_| UploaderGone),
            None => Ok(()),
        }
    }
}

/// The uploader stopped (because an upload failed).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct UploaderGone;

pub(super) fn new_pack_id(node_tag: &str) -> String {
    format!("{node_tag}-{}", hex::encode(rand::random::<[u8; 12]>()))
}

#[cfg(test)]
mod tests {
    use super::*;

    fn lens(windows: &[Cow<'_, [u8]>]) -> Vec<usize> {
        windows.iter().map(|w| w.len()).collect()
    }

    #[test]
    fn windows_respect_alignment() {
        let data = vec![7u8; 3 * CHUNK];
        let start = (5 * CHUNK - 4096) as u64;
        assert_eq!(lens(&aligned_windows(start, &[&data])), vec![4096, CHUNK, CHUNK, CHUNK - 4096]);
        assert_eq!(aligned_windows(0, &[&data[..100]]).len(), 1);
        assert!(aligned_windows(0, &[]).is_empty());
    }

    #[test]
    fn windows_do_not_depend_on_where_the_pieces_end() {
        let data: Vec<u8> = (0..5 * CHUNK + 8192).map(|i| (i * 7 % 251) as u8).collect();
        let start = (3 * CHUNK - 8192) as u64;
        let whole = aligned_windows(start, &[&data]);
        for cuts in [vec![4096], vec![CHUNK, 2 * CHUNK + 4096], vec![12288, 12288 + 4096, 3 * CHUNK]] {
            let mut pieces = Vec::new();
            let mut from = 0;
            for &cut in &cuts {
                pieces.push(&data[from..cut]);
                from = cut;
            }
            pieces.push(&data[from..]);
            assert_eq!(aligned_windows(start, &pieces), whole, "cut at {cuts:?}");
        }
        assert!(matches!(whole[1], Cow::Borrowed(_)), "a window within one piece is not copied");
    }

    #[test]
    fn a_window_spanning_pieces_is_gathered_in_one_buffer() {
        let data = vec![3u8; CHUNK];
        let mut cutter = WindowCutter::new(0);
        let mut windows = Vec::new();
        for piece in data.chunks(4096 * 3) {
            windows.extend(cutter.cut(piece).into_iter().map(Cow::into_owned));
        }
        assert_eq!(windows, [data]);
        assert_eq!(windows[0].capacity(), CHUNK, "grown once, to the window's size");
    }

    #[test]
    fn zero_detection() {
        assert!(is_zero(&[0; 4096]));
        assert!(is_zero(&[0; 13]));
        let mut d = vec![0u8; 4099];
        d[4098] = 1;
        assert!(!is_zero(&d));
        d[4098] = 0;
        d[3] = 1;
        assert!(!is_zero(&d));
    }

    #[test]
    fn dedup_zero_and_compression() {
        let index = ChunkIndex::default();
        let (tx, mut rx) = mpsc::channel(4);
        let mut random = vec![0u8; CHUNK];
        blake3::Hasher::new().update(b"seed").finalize_xof().fill(&mut random);
        let text = b"abcabcabc".repeat(CHUNK / 9 + 1)[..CHUNK].to_vec();
        let zero = vec![0u8; CHUNK];
        let mut w = ChunkWriter::new(&index, tx, "t", None, PackSlots::default());
        let refs = w.write(&[&random, &text, &zero, &random]).unwrap();
        w.flush().unwrap();
        assert_eq!(
            w.stats,
            ChunkStats {
                bytes_total: 4 * CHUNK as u64,
                chunks_total: 4,
                chunks_new: 2,
                chunks_zero: 1,
                bytes_new: 2 * CHUNK as u64,
                bytes_unchanged: 0,
                bytes_from_tree: 0,
                bytes_in_part: 0,
            }
        );
        assert!(refs[2].hash.is_empty());
        assert_eq!(refs[0].hash, refs[3].hash);
        let pack = rx.try_recv().unwrap();
        assert_eq!(pack.index.entries.len(), 2);
        let codecs: Vec<i32> = pack.index.entries.iter().map(|e| e.codec).collect();
        assert_eq!(codecs, vec![Codec::Raw as i32, Codec::Zstd as i32]);
        assert!(pack.data.len() < 2 * CHUNK);
        index.add(&pack.index);
        let (tx, _rx) = mpsc::channel(4);
        let mut again = ChunkWriter::new(&index, tx, "t", None, PackSlots::default());
        again.write(&[&random, &text]).unwrap();
        assert_eq!(again.stats.chunks_new, 0, "chunks in the index are not stored again");
    }
}
