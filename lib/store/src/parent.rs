//! The memory of a tree's previous checkpoint, which a dump tracking dirty pages builds on.
//!
//! Where the kernel tracks soft-dirty pages, CRIU sends the pages a tree did not write since
//! its previous (tracked) dump as "in parent" runs without data. The store keeps every
//! checkpoint whole: such a run's pages are the previous checkpoint's, so its chunks are
//! referenced again where a chunk of the new dump covers exactly what one of the previous did
//! (an aligned window unchanged and laid out as before, the common case). Where a window mixes
//! unchanged and written pages and the previous checkpoint held it as one chunk, its unchanged
//! pages reference their part of that chunk and the written ones are a chunk of their own; they
//! are read back only where that chunk was itself cut so (a window written again), or the
//! stretch of memory changed shape.
//! Those reads run beside the dump (`read_back.rs`): [`Parent::ask`] starts them, and a window
//! waits for its bytes only once many others are set aside.

use std::collections::{BTreeMap, HashMap, VecDeque};
use std::sync::{Arc, Mutex};

use stasis_proto::stasis::store::v1::{ChunkRef, MemoryImage};
use tokio::runtime::Handle;

use super::chunks::CHUNK;
use super::image_runs::{chunk_addresses, image_runs};
use super::index::ChunkHash;
use super::{Store, StoreError};
use stasis_criu_images::pages::{InParent, PageRun};

/// The previous checkpoint's memory, chunk by chunk.
#[derive(Debug)]
pub struct ParentMemory {
    checkpoint: String,
    /// Per pagemap: each chunk by its first address, with the address past its end and the
    /// flags of its pages.
    chunks: HashMap<u64, BTreeMap<u64, Held>>,
}

/// How unchanged pages are referenced ([`ParentMemory::references`]).
#[derive(Debug, PartialEq, Eq)]
pub(super) enum References {
    /// As the previous checkpoint referenced them.
    AsTheyWere(Vec<ChunkRef>),
    /// A part of the chunk that held their window.
    Part(ChunkRef),
}

/// A chunk reference of the previous checkpoint.
#[derive(Debug)]
pub(super) struct Held {
    /// The address past its end.
    end: u64,
    chunk: ChunkRef,
    /// The flags of its pages.
    flags: u32,
    /// It holds all its stretch's pages of its window: a part of it may be referenced
    /// without cutting the window's memory finer than into two kinds (unchanged, written).
    alone: bool,
}

/// Pages of the previous checkpoint could not be had.
#[derive(Debug, thiserror::Error)]
pub enum ParentError {
    #[error(
        "the previous checkpoint {checkpoint} does not hold the {nr_pages} pages at {vaddr:#x} of \
         pagemap {dst_id:#x} that the dump says are unchanged since"
    )]
    NotHeld { checkpoint: String, dst_id: u64, vaddr: u64, nr_pages: u64 },
    #[error("reading the previous checkpoint's unchanged pages failed")]
    Read(#[source] Box<StoreError>),
    #[error("the task reading the previous checkpoint's unchanged pages failed: {0}")]
    ReadTask(String),
    #[error("a read of the previous checkpoint's unchanged pages had failed already")]
    ReadFailedBefore,
    #[error("a reference of the previous checkpoint takes bytes {from}..{to} of a chunk which has {len}")]
    PastChunk { from: usize, to: usize, len: usize },
}

impl ParentMemory {
    /// The memory images of checkpoint `checkpoint`; `Err` says why they are malformed.
    pub fn new(checkpoint: &str, images: &[MemoryImage]) -> Result<Self, String> {
        let mut chunks: HashMap<u64, BTreeMap<u64, Held>> = HashMap::new();
        for image in images {
            let by_addr = chunks.entry(image.dst_id).or_default();
            for (run, mine) in image_runs(image)? {
                let (first, last) = (run.vaddr, run.vaddr + run.byte_len());
                for (at, chunk) in chunk_addresses(&run, mine) {
                    let end = at + u64::from(chunk.len);
                    let alone =
                        (at == first || at % CHUNK as u64 == 0) && (end == last || end % CHUNK as u64 == 0);
                    by_addr.insert(at, Held { end, chunk: chunk.clone(), flags: run.flags, alone });
                }
            }
        }
        Ok(ParentMemory { checkpoint: checkpoint.into(), chunks })
    }

    /// The checkpoint whose memory this is.
    pub fn checkpoint(&self) -> &str {
        &self.checkpoint
    }

    /// Whether the store's chunk index knows every stored chunk (all but zero ones): a
    /// collection may have taken them since, when the checkpoint was deleted.
    pub fn held_by(&self, store: &Store) -> bool {
        self.chunks.values().flat_map(|m| m.values()).map(|h| &h.chunk).all(|c| {
            c.hash.is_empty()
                || ChunkHash::try_from(c.hash.as_slice()).is_ok_and(|h| store.index.contains(&h))
        })
    }

    /// References to the unchanged pages `start..end` of pagemap `dst_id`, which lie in one
    /// window: the previous checkpoint's own where they start and end there (memory unchanged
    /// and laid out as before), else a part of the one chunk that held those pages' window
    /// alone (the window now mixes them with written pages); `None` if neither, when their
    /// bytes must be read.
    pub(super) fn references(&self, dst_id: u64, start: u64, end: u64) -> Option<References> {
        let held = self.covering(dst_id, start, end)?;
        if held.first().is_some_and(|(at, _)| *at == start) && held.last().is_some_and(|(_, h)| h.end == end)
        {
            let chunks = held.iter().map(|(_, h)| ChunkRef { fresh: false, ..h.chunk.clone() }).collect();
            return Some(References::AsTheyWere(chunks));
        }
        let [(at, h)] = held.as_slice() else { return None };
        let offset = match h.chunk.hash.is_empty() {
            true => 0,
            false => h.chunk.offset.checked_add(u32::try_from(start - at).ok()?)?,
        };
        let len = u32::try_from(end - start).ok()?;
        h.alone.then(|| References::Part(ChunkRef { hash: h.chunk.hash.clone(), len, fresh: false, offset }))
    }

    /// The chunks of pagemap `dst_id` that cover `start..end`, each with its address, in
    /// order; `None` unless they cover all of it.
    pub(super) fn covering(&self, dst_id: u64, start: u64, end: u64) -> Option<Vec<(u64, &Held)>> {
        let by_addr = self.chunks.get(&dst_id)?;
        let (&first, _) = by_addr.range(..=start).next_back()?;
        let mut out = Vec::new();
        let mut reach = first;
        for (&at, held) in by_addr.range(first..end) {
            if at != reach {
                return None;
            }
            out.push((at, held));
            reach = held.end;
        }
        (reach >= end && reach > start).then_some(out)
    }

    /// `start..end` of pagemap `dst_id` cut where the flags of the previous checkpoint's pages
    /// change: (start, end, flags) in order; `None` unless it holds all of them.
    pub(super) fn flags_over(&self, dst_id: u64, start: u64, end: u64) -> Option<Vec<(u64, u64, u32)>> {
        let mut parts: Vec<(u64, u64, u32)> = Vec::new();
        for (at, held) in self.covering(dst_id, start, end)? {
            let (from, to) = (start.max(at), end.min(held.end));
            match parts.last_mut() {
                Some(last) if last.2 == held.flags => last.1 = to,
                _ => parts.push((from, to, held.flags)),
            }
        }
        Some(parts)
    }
}

impl InParent for ParentMemory {
    fn has(&self, dst_id: u64) -> bool {
        self.chunks.contains_key(&dst_id)
    }

    fn covers(&self, run: &PageRun) -> bool {
        self.covering(run.dst_id, run.vaddr, run.vaddr + run.byte_len()).is_some()
    }
}

/// A chunk's bytes on their way: waiting for them blocks until they are here.
pub type Reading = Box<dyn FnOnce() -> Result<Vec<u8>, ParentError> + Send>;

/// How many of the chunks asked for last are remembered: a window cut by kind has at most a
/// few.
const RECENT: usize = 4;

/// Starts reading all of a chunk's bytes (of the chunk a reference takes all or part of).
type StartRead = Box<dyn FnMut(&ChunkRef) -> Reading + Send>;

/// A chunk of the previous checkpoint asked for: its read under way, or its bytes.
enum ChunkRead {
    Reading(Reading),
    Read(Arc<Vec<u8>>),
    /// Its read failed; whoever waited first got the error.
    Failed,
}

/// One chunk read shared by the windows that need it (the part of a window before a written
/// page, and the part after).
type SharedRead = Arc<Mutex<ChunkRead>>;

/// Bytes of the previous checkpoint asked for with [`Parent::ask`]: its chunks are read
/// meanwhile, so that the windows waiting for them can be many and their reads overlap.
pub struct Pending {
    parts: Vec<Part>,
}

enum Part {
    Zeros(usize),
    /// `from..to` of a chunk.
    Of(SharedRead, usize, usize),
}

impl Pending {
    /// The bytes, once their chunks are read.
    pub fn wait(self) -> Result<Vec<u8>, ParentError> {
        let mut out = Vec::new();
        for part in self.parts {
            match part {
                Part::Zeros(len) => out.resize(out.len() + len, 0),
                Part::Of(read, from, to) => {
                    let chunk = chunk_bytes(&read)?;
                    let part =
                        chunk.get(from..to).ok_or(ParentError::PastChunk { from, to, len: chunk.len() })?;
                    out.extend_from_slice(part);
                }
            }
        }
        Ok(out)
    }
}

/// The bytes of a shared chunk read, waiting for them the first time.
fn chunk_bytes(read: &SharedRead) -> Result<Arc<Vec<u8>>, ParentError> {
    let mut state = read.lock().unwrap_or_else(|p| p.into_inner());
    match std::mem::replace(&mut *state, ChunkRead::Failed) {
        ChunkRead::Reading(reading) => {
            let bytes = Arc::new(reading()?);
            *state = ChunkRead::Read(bytes.clone());
            Ok(bytes)
        }
        ChunkRead::Read(bytes) => {
            *state = ChunkRead::Read(bytes.clone());
            Ok(bytes)
        }
        ChunkRead::Failed => Err(ParentError::ReadFailedBefore),
    }
}

/// The previous checkpoint's memory and a way to read its chunks, for the chunker.
pub struct Parent {
    pub(super) memory: Arc<ParentMemory>,
    start: StartRead,
    /// The chunks asked for last, by hash: a window's pieces share them (the parts of a
    /// window cut by kind, and its written pages).
    recent: VecDeque<(Vec<u8>, SharedRead)>,
}

impl std::fmt::Debug for Parent {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Parent").field("checkpoint", &self.memory.checkpoint).finish()
    }
}

impl Parent {
    /// `memory` read through `start` (of a chunk reference, its read under way).
    pub fn new(memory: Arc<ParentMemory>, start: impl FnMut(&ChunkRef) -> Reading + Send + 'static) -> Self {
        Parent { memory, start: Box::new(start), recent: VecDeque::new() }
    }

    /// Asks for the bytes of `start..end` of pagemap `dst_id` in the previous checkpoint: the
    /// chunks holding them start being read.
    pub(super) fn ask(&mut self, dst_id: u64, start: u64, end: u64) -> Result<Pending, ParentError> {
        let memory = self.memory.clone();
        let chunks = memory.covering(dst_id, start, end).ok_or_else(|| ParentError::NotHeld {
            checkpoint: memory.checkpoint.clone(),
            dst_id,
            vaddr: start,
            nr_pages: (end - start) / stasis_criu_images::pages::PAGE_SIZE,
        })?;
        let mut parts = Vec::with_capacity(chunks.len());
        for (at, Held { chunk, .. }) in chunks {
            let from = (start.max(at) - at) as usize;
            let to = (end.min(at + u64::from(chunk.len)) - at) as usize;
            if chunk.hash.is_empty() {
                parts.push(Part::Zeros(to - from));
                continue;
            }
            let read = match self.recent.iter().find(|(hash, _)| *hash == chunk.hash) {
                Some((_, read)) => read.clone(),
                None => {
                    let read = Arc::new(Mutex::new(ChunkRead::Reading((self.start)(chunk))));
                    if self.recent.len() == RECENT {
                        self.recent.pop_front();
                    }
                    self.recent.push_back((chunk.hash.clone(), read.clone()));
                    read
                }
            };
            // The read is of the whole chunk, of which the reference may take a part.
            let offset = chunk.offset as usize;
            parts.push(Part::Of(read, offset + from, offset + to));
        }
        Ok(Pending { parts })
    }
}

impl Store {
    /// `memory` as a dump's parent, its chunks read from this store (on the runtime of
    /// `handle`, waited for from a thread outside it).
    pub fn parent(&self, memory: Arc<ParentMemory>, handle: Handle) -> Parent {
        let read = self.chunk_reader(memory.checkpoint.clone(), handle);
        Parent::new(memory, read)
    }

    /// Starts reads of chunks of checkpoint `checkpoint` from this store, as tasks on the
    /// runtime of `handle`; each is waited for from a thread outside it.
    fn chunk_reader(
        &self,
        checkpoint: String,
        handle: Handle,
    ) -> impl FnMut(&ChunkRef) -> Reading + Send + 'static {
        let store = self.clone();
        move |chunk| {
            let (store, checkpoint, chunk) = (store.clone(), checkpoint.clone(), chunk.clone());
            // All of the chunk, whatever part of it the reference takes (checked to be in it).
            let task = handle.spawn(async move {
                let find = |hash: &ChunkHash| store.index.get(hash);
                store.read_whole_chunk(&checkpoint, "memory", &chunk, find).await.map(|(whole, _)| whole)
            });
            let handle = handle.clone();
            Box::new(move || match handle.block_on(task) {
                Ok(read) => read.map_err(|e| ParentError::Read(Box::new(e))),
                Err(e) => Err(ParentError::ReadTask(e.to_string())),
            })
        }
    }
}

#[cfg(test)]
#[path = "parent_tests.rs"]
mod tests;
