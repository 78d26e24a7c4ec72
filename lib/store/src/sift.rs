//! Sifting a dump as CRIU sends it, for a tree that runs on (a checkpoint left running) and
//! whose memory the store mostly holds already (a later checkpoint of the same tree).
//!
//! The page server hands the pages over in blocks from the daemon's pool (`stream.rs`), and a
//! thread of the dump's own hashes each window of memory as it arrives, while CRIU sends the
//! next pages: a window the store holds already is referenced and dropped, and only those it
//! lacks are staged (in memory up to the daemon's bound, then in the spill file), to be
//! compressed and uploaded once the tree runs again. Staging then takes the checkpoint's
//! delta, not the tree's size, and no page is hashed twice. When the hashing falls behind,
//! the pool runs dry and CRIU waits: the tree stays frozen for the longer of the two, not for
//! both. The memory images are whole when the dump ends: what is left is packing new chunks.
//!
//! Whether the store holds a chunk is asked under the commit guard the checkpoint holds from
//! before the dump to its commit, so no collection removes a chunk it referenced meanwhile.

use std::collections::HashSet;
use std::io;
use std::path::Path;
use std::sync::Arc;
use std::thread::JoinHandle;

use rayon::prelude::*;
use stasis_proto::stasis::store::v1::{ChunkRef, MemoryImage};

use super::Store;
use super::chunks::{ChunkStats, Kind};
use super::crypto::Cipher;
use super::index::{ChunkHash, ChunkIndex};
use super::memory::{ChunkingError, MemoryChunker, WindowSink};
use super::parent::Parent;
use super::staging::{Staged, Staging, StagingBudget};
use super::stream::{BlockPool, StreamSink, StreamSource, Unfinished, stream};
use stasis_criu_images::pages::{PAGE_SIZE, PE_PRESENT, PageRun, PageSink};

/// Windows of a block hashed one by one rather than in parallel: splitting a few among threads
/// costs more than it saves.
const PARALLEL_FROM: usize = 8;

/// A dump being sifted: its pages go to the [`StreamSink`] [`Store::sift`] gave with it.
pub struct Sifting {
    thread: JoinHandle<io::Result<Sifted>>,
}

/// What the windows go to: the index asked, the new ones staged.
struct Keeper {
    index: Arc<ChunkIndex>,
    cipher: Option<Arc<Cipher>>,
    staging: Staging,
    /// Hashes of the staged chunks, in the order they were staged.
    hashes: Vec<ChunkHash>,
    staged: HashSet<ChunkHash>,
    stats: ChunkStats,
}

/// A sifted dump: its memory images, whole, and the chunks of them the store lacked.
#[derive(Debug)]
pub struct Sifted {
    memory: Vec<MemoryImage>,
    new: Staged,
    hashes: Vec<ChunkHash>,
    stats: ChunkStats,
}

impl Store {
    /// Sifts a dump whose pages go to the sink returned, in blocks of `pool`; its new chunks
    /// are staged within `budget` (about `expected` bytes of it made ready now, before the
    /// dump), the rest in a file at `spill_path`; runs in parent are `parent`'s pages. Hold
    /// the checkpoint's commit guard from before the dump to its commit.
    pub fn sift(
        &self,
        budget: &StagingBudget,
        spill_path: &Path,
        pool: &BlockPool,
        expected: u64,
        parent: Option<Parent>,
    ) -> io::Result<(StreamSink, Sifting)> {
        let mut staging = Staging::new(budget, spill_path);
        staging.reserve(expected);
        let keeper = Keeper {
            index: self.index.clone(),
            cipher: self.cipher.clone(),
            staging,
            hashes: Vec::new(),
            staged: HashSet::new(),
            stats: ChunkStats::default(),
        };
        let (sink, source) = stream(pool);
        let thread =
            std::thread::Builder::new().name("sift".into()).spawn(move || sift(source, keeper, parent))?;
        Ok((sink, Sifting { thread }))
    }
}

impl Sifting {
    /// Waits until the last block is sifted (the sink finished, or dropped: then the dump is
    /// unfinished and this an error).
    pub fn finish(self) -> io::Result<Sifted> {
        self.thread.join().unwrap_or_else(|_| Err(io::Error::other("the thread sifting a dump panicked")))
    }
}

/// Sifts what `source` brings; the memory images are made whole at its end.
fn sift(source: StreamSource, mut keeper: Keeper, parent: Option<Parent>) -> io::Result<Sifted> {
    let mut chunker = MemoryChunker::new(parent);
    source.each(|received| chunker.receive(&mut keeper, received).map(drop)).map_err(
        |failure| match failure {
            Ok(Unfinished) => {
                io::Error::new(io::ErrorKind::UnexpectedEof, "the dump ended before its pages did")
            }
            Err(e) => chunking_failed(e),
        },
    )?;
    let memory = chunker.finish(&mut keeper).map_err(chunking_failed)?;
    let Keeper { staging, hashes, stats, .. } = keeper;
    Ok(Sifted { memory, new: staging.finish()?, hashes, stats })
}

fn chunking_failed(e: ChunkingError<io::Error>) -> io::Error {
    match e {
        ChunkingError::Sink(e) => e,
        ChunkingError::Parent(e) => io::Error::other(e),
    }
}

impl WindowSink for Keeper {
    type Error = io::Error;

    fn stats(&mut self) -> &mut ChunkStats {
        &mut self.stats
    }

    fn take(&mut self, windows: &[&[u8]]) -> io::Result<Vec<ChunkRef>> {
        let (cipher, index) = (self.cipher.as_deref(), self.index.as_ref());
        let kinds: Vec<Kind> = if windows.len() >= PARALLEL_FROM {
            windows.par_iter().map(|raw| Kind::of(cipher, index, raw)).collect()
        } else {
            windows.iter().map(|raw| Kind::of(cipher, index, raw)).collect()
        };
        let mut refs = Vec::with_capacity(windows.len());
        for (raw, kind) in windows.iter().zip(kinds) {
            refs.push(kind.reference(raw.len()));
            let first = match kind {
                Kind::New(hash) if self.staged.insert(hash) => {
                    self.stage(hash, raw)?;
                    true
                }
                _ => false,
            };
            self.stats.count(raw.len(), &kind, first);
        }
        Ok(refs)
    }
}

impl Keeper {
    /// Stages a new chunk: as a run of its own pages in the staging, whose runs then are the
    /// new chunks in order.
    fn stage(&mut self, hash: ChunkHash, raw: &[u8]) -> io::Result<()> {
        if !(raw.len() as u64).is_multiple_of(PAGE_SIZE) {
            return Err(io::Error::new(io::ErrorKind::InvalidData, "a memory chunk that is not whole pages"));
        }
        let run = PageRun { dst_id: 0, vaddr: 0, nr_pages: raw.len() as u64 / PAGE_SIZE, flags: PE_PRESENT };
        self.staging.run(run, &mut &raw[..])?;
        self.hashes.push(hash);
        Ok(())
    }
}

impl Sifted {
    /// The memory images, every chunk referenced; the staging goes with the rest (once the new
    /// chunks are packed).
    pub(super) fn into_memory(self) -> Vec<MemoryImage> {
        self.memory
    }

    /// How the dump's memory divided into zero, held and new chunks.
    pub fn stats(&self) -> ChunkStats {
        self.stats
    }

    /// Bytes of the new chunks, to be packed.
    pub fn new_bytes(&self) -> u64 {
        self.new.len()
    }

    /// The new chunks, `batch` at a time, each batch's spilled memory let go once `each` has
    /// taken it.
    pub(super) fn each_new<E>(
        &self,
        batch: usize,
        mut each: impl FnMut(&[(ChunkHash, &[u8])]) -> Result<(), E>,
    ) -> Result<(), E> {
        let runs = self.new.runs();
        for (runs, hashes) in runs.chunks(batch).zip(self.hashes.chunks(batch)) {
            let chunks: Vec<(ChunkHash, &[u8])> =
                hashes.iter().zip(runs).map(|(hash, run)| (*hash, self.new.bytes(run))).collect();
            each(&chunks)?;
            runs.iter().for_each(|run| self.new.release(run));
        }
        Ok(())
    }
}

#[cfg(test)]
pub(super) mod tests {
    use std::path::Path;
    use std::sync::Arc;

    use super::*;
    use crate::chunks::CHUNK;
    use crate::{DumpPages, Manifest, MemoryMode};
    use stasis_criu_images::testing::write_dump_images;

    const PAGE: usize = PAGE_SIZE as usize;
    const WINDOWS: usize = 64;
    const DST: u64 = (7 << 8) | 1;

    /// 4 MiB of a task's memory from 0x10000: bytes differing on every page, but windows
    /// 10..18 all zero and window 61 a copy of window 60.
    fn memory() -> Vec<u8> {
        let mut memory: Vec<u8> =
            (0..WINDOWS * CHUNK).map(|i| (i / PAGE) as u8 ^ (i / 7919) as u8 ^ (i % 251) as u8).collect();
        memory[10 * CHUNK..18 * CHUNK].fill(0);
        memory.copy_within(60 * CHUNK..61 * CHUNK, 61 * CHUNK);
        memory
    }

    /// Sifts `memory` as CRIU sends it, in transfers of 17 pages, staging at most `budget`
    /// bytes in memory and the rest in a spill file.
    fn sift(store: &Store, dir: &Path, memory: &[u8], budget: u64) -> Sifted {
        std::fs::create_dir_all(dir).unwrap();
        let pool = BlockPool::default();
        let (mut sink, sifting) =
            store.sift(&StagingBudget::new(budget), &dir.join("spill"), &pool, 0, None).unwrap();
        sink.open(DST).unwrap();
        for (i, piece) in memory.chunks(17 * PAGE).enumerate() {
            let vaddr = 0x10000 + (i * 17 * PAGE) as u64;
            let run =
                PageRun { dst_id: DST, vaddr, nr_pages: (piece.len() / PAGE) as u64, flags: PE_PRESENT };
            sink.run(run, &mut &piece[..]).unwrap();
        }
        sink.finish().unwrap();
        sifting.finish().unwrap()
    }

    /// Stores and commits the pages of a dump of task 7 as checkpoint `id`, restores it, and
    /// returns the memory.
    pub(crate) async fn stored_and_restored(
        store: &Store,
        dir: &Path,
        pages: DumpPages,
        id: &str,
    ) -> (Manifest, Vec<u8>) {
        let images = dir.join("images");
        std::fs::create_dir_all(&images).unwrap();
        write_dump_images(&images, 7, &[]);
        let stored = store.store_dump(pages, &images, &[], Arc::new(|_, _| {})).await.unwrap();
        let manifest =
            Manifest { id: id.into(), memory: stored.memory, files: stored.files, ..Default::default() };
        store.commit(&manifest, &store.begin_commit().await.unwrap()).await.unwrap();
        let out = dir.join("restored");
        std::fs::create_dir_all(&out).unwrap();
        store.materialize_as(&manifest, &out, MemoryMode::Eager, Arc::new(|_, _| {})).await.unwrap();
        (manifest, std::fs::read(out.join("pages-1.img")).unwrap())
    }

    #[tokio::test(flavor = "multi_thread")]
    async fn after_a_checkpoint_only_the_changed_windows_are_staged_and_each_restores_whole() {
        let dir = tempfile::tempdir().unwrap();
        let store = Store::in_dir(&dir.path().join("store"));
        let before = memory();
        let first = sift(&store, &dir.path().join("a"), &before, 64 << 20);
        // All but the zero windows and the repeated one.
        assert_eq!(first.new_bytes(), ((WINDOWS - 8 - 1) * CHUNK) as u64);
        let stats = first.stats();
        assert_eq!((stats.chunks_total, stats.chunks_zero, stats.chunks_new), (64, 8, 55));
        let (_, restored) = stored_and_restored(
            &store,
            &dir.path().join("a"),
            DumpPages::Sifted(Box::new(first)),
            "20261127-000000-aaaaaa",
        )
        .await;
        assert!(restored == before, "the first checkpoint restores byte for byte");

        // One page changed in window 5, one byte in window 40; the staging has room for one
        // chunk in memory, so the other spills.
        let mut after = before.clone();
        after[5 * CHUNK + 3 * PAGE..5 * CHUNK + 4 * PAGE].fill(0xee);
        after[40 * CHUNK + 17] ^= 0x5a;
        let second = sift(&store, &dir.path().join("b"), &after, CHUNK as u64);
        assert_eq!(second.new_bytes(), 2 * CHUNK as u64, "only the two changed windows are staged");
        assert_eq!(second.stats().chunks_new, 2);
        let fresh: Vec<usize> =
            second.memory[0].chunks.iter().enumerate().filter(|(_, c)| c.fresh).map(|(i, _)| i).collect();
        assert_eq!(fresh, [5, 40], "the references say which chunks were new");
        let (_, restored) = stored_and_restored(
            &store,
            &dir.path().join("b"),
            DumpPages::Sifted(Box::new(second)),
            "20261127-000001-bbbbbb",
        )
        .await;
        assert!(restored == after, "the second checkpoint restores byte for byte");
    }

    #[test]
    fn a_dump_that_ends_before_its_pages_do_is_an_error() {
        let dir = tempfile::tempdir().unwrap();
        let store = Store::in_dir(&dir.path().join("store"));
        let pool = BlockPool::default();
        let (mut sink, sifting) =
            store.sift(&StagingBudget::new(1 << 20), &dir.path().join("spill"), &pool, 0, None).unwrap();
        let run = PageRun { dst_id: DST, vaddr: 0x10000, nr_pages: 3, flags: PE_PRESENT };
        sink.run(run, &mut &vec![1u8; 3 * PAGE][..]).unwrap();
        drop(sink);
        let error = sifting.finish().unwrap_err();
        assert_eq!(error.kind(), io::ErrorKind::UnexpectedEof, "{error}");
    }
}
