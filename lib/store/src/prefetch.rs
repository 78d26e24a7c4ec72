//! Serving lazily restored memory: a bounded cache of fetched, verified chunks, filled by a
//! prefetcher task in [`LazyMemory::prefetch_order`] and on demand, and taken by the fault
//! server (`engine/hot_restore/`), which puts them into the restored processes.
//!
//! ```text
//! fault server (blocking thread)           prefetcher (async task)
//!   get(chunk) -> not cached: asked for ──▶  fetch it first (a fault's go ahead of the rest)
//!   polls the waker                    ◀──   decompress, verify, insert, write the waker
//!   copies it into every process               otherwise: next chunks in prefetch order
//!   release(chunk): it leaves the cache        while cache + in flight < capacity
//! ```
//! An eager restore gives a [`Placer`]: the thread that decoded a chunk puts it in place
//! itself, while its bytes are in that CPU's caches, and the chunk skips the cache and the
//! fault server (told through [`ChunkReader::take_placed`]); one the placer cannot put in
//! place now is cached as any other.
//!
//! Every chunk is checked ([`decode_chunk`]) before it is cached or placed. A fetch that fails, or takes
//! longer than the timeout, fails the whole session: the caller must then kill the tree,
//! whose memory can no longer be completed.

use std::borrow::Cow;
use std::collections::{HashMap, VecDeque};
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex, MutexGuard};
use std::time::Duration;

use std::os::fd::{AsFd, BorrowedFd};

use futures::StreamExt;
use futures::stream::FuturesUnordered;
use nix::sys::eventfd::{EfdFlags, EventFd};
use tokio::sync::Notify;
use tracing::{debug, warn};

use bytes::Bytes;

use super::assemble::{Verify, decode_chunk};
use super::lazy_memory::LazyMemory;
use super::{Store, StoreError};

/// Chunks are fetched in batches of at most this much, those the fault server waits for too:
/// fewer, larger range reads (each is a request to the store, and object_store merges adjacent
/// ranges of a pack into one). Faults that queue up while a batch is under way go in the next
/// one together; on a store far away that is what keeps a working set from arriving a few
/// chunks per round trip.
const BATCH_BYTES: u64 = 16 << 20;
/// Of the chunks asked for ahead of faults, how much may ride in a batch that a fault waits
/// for: a batch's chunks are ready only once all of it has arrived, so more would hold the
/// fault back (a process walking its memory asks for up to 32 MiB ahead). The rest go in
/// batches of their own.
const SOON_WITH_URGENT: u64 = 1 << 20;
/// Of a session's cache, how much the prefetcher fills by default (see
/// [`FetchSettings::prefetch_bytes`]).
pub const PREFETCH_BYTES: u64 = 64 << 20;
/// Batches fetched at the same time...
const BATCHES_IN_FLIGHT: usize = 4;
/// ...and prefetch batches, while a batch something waits for is under way.
const BATCHES_WHILE_URGENT: usize = 2;

/// Puts chunks in place from the threads that decode them (see the module's text).
pub trait Placer: Send + Sync {
    /// Puts `bytes`, the memory of task `pid` at image address `addr`, in place if it can now;
    /// whether it did (all of it).
    fn place(&self, pid: u64, addr: u64, bytes: &[u8]) -> bool;
}

/// How a lazy restore fetches memory.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct FetchSettings {
    /// Bytes of fetched memory not yet put in place that may be held.
    pub cache_bytes: u64,
    /// Of those, how many may be chunks in the prefetcher's own order; the rest is for chunks
    /// asked for. Prefetched chunks are put in place when no fault that follows a pattern
    /// waits, so while a job keeps faulting more would only wait in the cache, having taken
    /// the store's and the decoder's time from the chunks the job asks for.
    pub prefetch_bytes: u64,
    /// How long a read waits for the store before the session fails.
    pub timeout: Duration,
    /// Prefetch the chunks new in the checkpoint first (else in address order only).
    pub fresh_first: bool,
}

/// Serving lazily restored memory failed.
#[derive(Debug, Clone, thiserror::Error)]
pub enum LazyFetchError {
    #[error("the store did not deliver memory of checkpoint {id} within {secs} s")]
    Timeout { id: String, secs: u64 },
    #[error("fetching memory of checkpoint {id} failed")]
    Store {
        id: String,
        #[source]
        source: Arc<StoreError>,
    },
    #[error("chunk {chunk} of checkpoint {id} (pack {pack}) is corrupted: {reason}")]
    Corrupt { id: String, chunk: String, pack: String, reason: String },
    #[error("the fetch task of checkpoint {id} failed: {reason}")]
    Task { id: String, reason: String },
    #[error("the lazy restore was stopped")]
    Stopped,
}

#[derive(Debug, Clone)]
enum Slot {
    /// Not in the cache (not fetched yet, or released).
    Absent,
    Fetching,
    Ready(Bytes),
}

struct State {
    slots: Vec<Slot>,
    /// Chunks no process needs any more, or put in place by the placer: not fetched again
    /// unless asked for, and one that arrives so marked leaves the cache at once.
    released: Vec<bool>,
    /// Chunks cached since the fault server last looked, in the order they arrived.
    arrived: Vec<usize>,
    /// Chunks the placer put in place since the fault server last looked.
    placed: Vec<usize>,
    /// Bytes held in `Ready` slots and in flight.
    held: u64,
    /// Chunks a fault waits for: fetched whether or not the cache has room.
    urgent: VecDeque<usize>,
    /// Chunks asked for ahead of faults, or dropped and wanted again: fetched next, while the
    /// cache has room.
    soon: VecDeque<usize>,
    /// Which chunks `soon` holds (a fault asks for tens of chunks ahead: looked up by index,
    /// not by a walk of the queue).
    in_soon: Vec<bool>,
    failure: Option<LazyFetchError>,
    stopped: bool,
    /// Only chunks asked for are fetched until the prefetch is started.
    prefetching: bool,
}

struct Shared {
    memory: LazyMemory,
    placer: Option<Arc<dyn Placer>>,
    state: Mutex<State>,
    /// Written whenever chunks arrive or the session fails: the fault server polls it.
    arrived: EventFd,
    wake: Notify,
    fetched: AtomicU64,
}

impl Shared {
    fn lock(&self) -> MutexGuard<'_, State> {
        self.state.lock().unwrap_or_else(|p| p.into_inner())
    }

    fn fail(&self, error: LazyFetchError) {
        let mut st = self.lock();
        st.failure.get_or_insert(error);
        drop(st);
        self.tell_arrived();
        self.wake.notify_one();
    }

    fn tell_arrived(&self) {
        if let Err(e) = self.arrived.write(1) {
            warn!(error = %e, "cannot wake the fault server");
        }
    }
}

/// Controls a lazy session's prefetcher.
#[derive(Clone)]
pub struct LazyFetch {
    shared: Arc<Shared>,
}

impl LazyFetch {
    /// Bytes fetched from the store so far (as stored: compressed).
    pub fn bytes_fetched(&self) -> u64 {
        self.shared.fetched.load(Ordering::Relaxed)
    }

    /// Stops prefetching; readers waiting get [`LazyFetchError::Stopped`].
    pub fn stop(&self) {
        self.shared.fail(LazyFetchError::Stopped);
        self.shared.lock().stopped = true;
        self.shared.wake.notify_one();
    }
}

/// A chunk's bytes, as the fault server puts them in place.
#[derive(Debug, Clone)]
pub enum ChunkData {
    /// An all-zero chunk (never stored).
    Zero,
    Bytes(Bytes),
}

/// How much a chunk that is not cached is wanted.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Ask {
    /// A process waits on it: fetched before anything else.
    Urgent,
    /// Soon (after a fault, the chunks that follow): fetched with the urgent ones, after them,
    /// while the cache has room.
    Soon,
    /// Only if the prefetcher no longer brings it (it was released).
    IfDropped,
}

/// The fault server's side: takes chunks, asking for those not cached.
pub struct ChunkReader {
    shared: Arc<Shared>,
}

impl Store {
    /// Starts serving `memory`: a prefetcher task that keeps at most `settings.cache_bytes`
    /// of chunks not yet released, each fetch given at most `settings.timeout`. Unless
    /// `prefetch_now`, it fetches only chunks asked for until [`ChunkReader::start_prefetch`].
    /// Chunks go to `placer` first, where there is one.
    pub fn start_lazy_fetch(
        &self,
        memory: LazyMemory,
        settings: FetchSettings,
        prefetch_now: bool,
        placer: Option<Arc<dyn Placer>>,
    ) -> std::io::Result<(ChunkReader, LazyFetch)> {
        let n = memory.chunks.len();
        let state = State {
            slots: vec![Slot::Absent; n],
            released: vec![false; n],
            arrived: Vec::new(),
            placed: Vec::new(),
            held: 0,
            urgent: VecDeque::new(),
            soon: VecDeque::new(),
            in_soon: vec![false; n],
            failure: None,
            stopped: false,
            prefetching: prefetch_now,
        };
        let arrived = EventFd::from_value_and_flags(0, EfdFlags::EFD_CLOEXEC | EfdFlags::EFD_NONBLOCK)?;
        let shared = Arc::new(Shared {
            memory,
            placer,
            state: Mutex::new(state),
            arrived,
            wake: Notify::new(),
            fetched: AtomicU64::new(0),
        });
        tokio::spawn(prefetch(self.clone(), shared.clone(), settings));
        Ok((ChunkReader { shared: shared.clone() }, LazyFetch { shared }))
    }
}

impl ChunkReader {
    pub fn memory(&self) -> &LazyMemory {
        &self.shared.memory
    }

    /// Chunk `i`'s bytes if they are cached (or it is a zero chunk); otherwise asks for it as
    /// `ask` says, and returns `None`: the waker says when more chunks arrived. An error once
    /// the session failed.
    pub fn get(&self, i: usize, ask: Ask) -> Result<Option<ChunkData>, LazyFetchError> {
        let mut st = self.shared.lock();
        if let Some(e) = &st.failure {
            return Err(e.clone());
        }
        if self.shared.memory.chunks[i].stored.is_none() {
            return Ok(Some(ChunkData::Zero));
        }
        match &st.slots[i] {
            Slot::Ready(data) => return Ok(Some(ChunkData::Bytes(data.clone()))),
            // Needed after all: kept when it arrives, even if it was released meanwhile.
            Slot::Fetching => st.released[i] = false,
            Slot::Absent if ask == Ask::IfDropped && !st.released[i] => {}
            Slot::Absent => {
                st.released[i] = false;
                // A duplicate entry is skipped when its turn comes.
                match ask {
                    Ask::Urgent => st.urgent.push_front(i),
                    _ if !st.in_soon[i] => {
                        st.in_soon[i] = true;
                        st.soon.push_back(i);
                    }
                    _ => {}
                }
                self.shared.wake.notify_one();
            }
        }
        Ok(None)
    }

    /// Chunk `i`'s bytes if they are cached (or it is a zero chunk), without asking for it.
    pub fn peek(&self, i: usize) -> Option<ChunkData> {
        if self.shared.memory.chunks[i].stored.is_none() {
            return Some(ChunkData::Zero);
        }
        match &self.shared.lock().slots[i] {
            Slot::Ready(data) => Some(ChunkData::Bytes(data.clone())),
            _ => None,
        }
    }

    /// The chunks cached since the last call, in the order they arrived.
    pub fn take_arrived(&self) -> Vec<usize> {
        std::mem::take(&mut self.shared.lock().arrived)
    }

    /// The chunks the placer put in place since the last call.
    pub fn take_placed(&self) -> Vec<usize> {
        std::mem::take(&mut self.shared.lock().placed)
    }

    /// No process needs chunk `i` any more: it leaves the cache (one being fetched, when it
    /// arrives).
    pub fn release(&self, i: usize) {
        let mut st = self.shared.lock();
        st.released[i] = true;
        if matches!(st.slots[i], Slot::Ready(_)) {
            st.slots[i] = Slot::Absent;
            st.held -= u64::from(self.shared.memory.chunks[i].len);
            self.shared.wake.notify_one();
        }
    }

    /// Fetches every chunk from now on, not only those asked for.
    pub fn start_prefetch(&self) {
        self.shared.lock().prefetching = true;
        self.shared.wake.notify_one();
    }

    /// Why the session failed, if it did.
    pub fn failure(&self) -> Option<LazyFetchError> {
        self.shared.lock().failure.clone()
    }

    /// Fails the session (a chunk waited on too long, say): the prefetcher stops.
    pub fn fail(&self, error: LazyFetchError) {
        self.shared.fail(error);
    }

    /// Readable when chunks arrived (or the session failed) since the last [`Self::drain`].
    pub fn waker(&self) -> BorrowedFd<'_> {
        self.shared.arrived.as_fd()
    }

    /// Resets the waker.
    pub fn drain(&self) {
        let _ = self.shared.arrived.read();
    }
}

/// The prefetcher: urgent chunks first, then the prefetch order while there is room.
async fn prefetch(store: Store, shared: Arc<Shared>, settings: FetchSettings) {
    let FetchSettings { cache_bytes: capacity, prefetch_bytes, timeout, fresh_first } = settings;
    let order = shared.memory.prefetch_order(fresh_first);
    let mut cursor = 0usize;
    let mut in_flight = FuturesUnordered::new();
    // Batches in flight that something waits for.
    let mut urgent_in_flight = 0usize;
    loop {
        loop {
            // Chunks something waits for get a batch of their own even when prefetches fill
            // every slot, and fewer prefetches run while one is under way: on a small machine
            // their decompression slows the waited-for one down, while on a store far away
            // they are what brings a job's working set (fresh-first) in large reads.
            let (urgent, prefetching) = {
                let st = shared.lock();
                (!st.urgent.is_empty() || !st.soon.is_empty(), st.prefetching)
            };
            if in_flight.len() >= BATCHES_IN_FLIGHT + usize::from(urgent) {
                break;
            }
            let prefetches = in_flight.len() - urgent_in_flight;
            let prefetch = prefetching && (urgent_in_flight == 0 || prefetches < BATCHES_WHILE_URGENT);
            let room = if prefetch { capacity.min(prefetch_bytes) } else { 0 };
            let (batch, is_urgent) = next_batch(&shared, &order, &mut cursor, capacity, room);
            if batch.is_empty() {
                break;
            }
            urgent_in_flight += usize::from(is_urgent);
            let fetch = fetch_batch(store.clone(), shared.clone(), batch, timeout);
            in_flight.push(async move { (is_urgent, fetch.await) });
        }
        let (done, stopped) = {
            let st = shared.lock();
            (st.failure.is_some(), st.stopped)
        };
        if done || stopped {
            return;
        }
        let asked = {
            let st = shared.lock();
            !st.urgent.is_empty() || !st.soon.is_empty()
        };
        if cursor >= order.len() && in_flight.is_empty() && !asked {
            // Everything was prefetched once; only refetches of dropped chunks remain.
            shared.wake.notified().await;
            continue;
        }
        tokio::select! {
            Some((was_urgent, result)) = in_flight.next() => {
                urgent_in_flight -= usize::from(was_urgent);
                if let Err(e) = result {
                    warn!(error = %e, "lazy restore: fetching memory failed");
                    shared.fail(e);
                }
            }
            () = shared.wake.notified() => {}
        }
    }
}

/// Picks the next chunks to fetch and marks them `Fetching`: those something waits for, or
/// else the next ones in prefetch order while the cache holds less than `prefetch_room`
/// (none: 0). Says whether they are waited for.
fn next_batch(
    shared: &Shared,
    order: &[usize],
    cursor: &mut usize,
    capacity: u64,
    prefetch_room: u64,
) -> (Vec<usize>, bool) {
    let chunks = &shared.memory.chunks;
    let mut st = shared.lock();
    let (mut batch, mut bytes, mut urgent_bytes) = (Vec::new(), 0u64, 0u64);
    while bytes < BATCH_BYTES {
        let room = st.held + bytes < capacity;
        // Behind chunks a fault waits for, only a little of what was asked for ahead.
        let soon_fits = urgent_bytes == 0 || bytes - urgent_bytes < SOON_WITH_URGENT;
        let (next, urgent) = match st.urgent.pop_front() {
            Some(i) => (Some(i), true),
            None if room && soon_fits => {
                let next = st.soon.pop_front();
                if let Some(i) = next {
                    st.in_soon[i] = false;
                }
                (next, false)
            }
            None => (None, false),
        };
        let Some(i) = next else { break };
        if matches!(st.slots[i], Slot::Absent) && !st.released[i] {
            st.slots[i] = Slot::Fetching;
            let len = u64::from(chunks[i].len);
            bytes += len;
            urgent_bytes += if urgent { len } else { 0 };
            batch.push(i);
        }
    }
    // Chunks asked for go alone, so that they arrive as soon as possible.
    if !batch.is_empty() {
        st.held += bytes;
        return (batch, true);
    }
    while bytes < BATCH_BYTES && *cursor < order.len() && st.held + bytes < prefetch_room {
        let i = order[*cursor];
        *cursor += 1;
        if matches!(st.slots[i], Slot::Absent) && !st.released[i] {
            st.slots[i] = Slot::Fetching;
            bytes += u64::from(chunks[i].len);
            batch.push(i);
        }
    }
    st.held += bytes;
    (batch, false)
}

/// Fetches `batch` (grouped by pack, ranges read in one request per pack), verifies each
/// chunk and hands it to the placer, or else puts it in the cache.
async fn fetch_batch(
    store: Store,
    shared: Arc<Shared>,
    batch: Vec<usize>,
    timeout: Duration,
) -> Result<(), LazyFetchError> {
    let id = shared.memory.id.clone();
    let mut by_pack: HashMap<Arc<str>, Vec<usize>> = HashMap::new();
    for &i in &batch {
        let (_, loc) = shared.memory.chunks[i].stored.as_ref().expect("only stored chunks are fetched");
        by_pack.entry(loc.pack.clone()).or_default().push(i);
    }
    let fetches = by_pack.into_iter().map(|(pack, chunks)| {
        let (store, shared) = (&store, &shared);
        async move {
            // Parts of one stored chunk (a window cut by kind) are read once.
            let mut ranges: Vec<std::ops::Range<u64>> = Vec::with_capacity(chunks.len());
            let mut blob_of: HashMap<u64, usize> = HashMap::with_capacity(chunks.len());
            for &i in &chunks {
                let (_, loc) = shared.memory.chunks[i].stored.as_ref().expect("stored");
                blob_of.entry(loc.offset).or_insert_with(|| {
                    ranges.push(loc.offset..loc.offset + u64::from(loc.stored_len));
                    ranges.len() - 1
                });
            }
            let blobs = store.read_ranges(&shared.memory.id, &pack, &ranges).await?;
            // A range read into a buffer of its own (a local store's reads, each unshared) holds
            // only its chunk: a chunk stored as it is can be cached as that buffer, without a
            // copy, and holds no more memory than the cache counts. A slice of a larger buffer
            // (a remote store's download that merged nearby ranges) would hold all of it.
            let own_buffer: Vec<bool> = blobs.iter().map(|b| store.reads_apart && b.is_unique()).collect();
            let blobs: Vec<(Bytes, bool)> = chunks
                .iter()
                .map(|&i| {
                    let (_, loc) = shared.memory.chunks[i].stored.as_ref().expect("stored");
                    let b = blob_of[&loc.offset];
                    (blobs[b].clone(), own_buffer[b])
                })
                .collect();
            let fetched: u64 = ranges.iter().map(|r| r.end - r.start).sum();
            Ok::<_, StoreError>((pack, chunks, blobs, fetched))
        }
    });
    let fetched = tokio::time::timeout(timeout, futures::future::try_join_all(fetches)).await;
    let fetched = match fetched {
        Err(_) => return Err(LazyFetchError::Timeout { id, secs: timeout.as_secs() }),
        Ok(Err(e)) => return Err(LazyFetchError::Store { id, source: Arc::new(e) }),
        Ok(Ok(f)) => f,
    };
    let verify = shared.clone();
    let cipher = store.cipher.clone();
    // Each chunk is cached as soon as it is verified: the first of a batch (the one a fault
    // waits for) need not wait for the rest to be decompressed.
    tokio::task::spawn_blocking(move || {
        for (pack, chunks, blobs, bytes) in fetched {
            verify.fetched.fetch_add(bytes, Ordering::Relaxed);
            let offset_of = |i: usize| verify.memory.chunks[i].stored.as_ref().expect("stored").1.offset;
            // A stored chunk several parts of the batch take is decoded once, kept until its
            // last part is cut from it.
            let mut parts_left: HashMap<u64, usize> = HashMap::new();
            chunks.iter().for_each(|&i| *parts_left.entry(offset_of(i)).or_default() += 1);
            let mut decoded: HashMap<u64, Bytes> = HashMap::new();
            let mut placed = false;
            for (i, (blob, own_buffer)) in chunks.into_iter().zip(blobs) {
                let chunk = &verify.memory.chunks[i];
                let (hash, loc) = chunk.stored.as_ref().expect("stored");
                let whole = match decoded.remove(&loc.offset) {
                    Some(whole) => whole,
                    None => match decode_chunk(&blob, loc, hash, cipher.as_deref(), Verify::Stored) {
                        Ok(Cow::Borrowed(_)) if own_buffer => blob.clone(),
                        Ok(data) => Bytes::from(data.into_owned()),
                        Err(reason) => {
                            return Err(LazyFetchError::Corrupt {
                                id: verify.memory.id.clone(),
                                chunk: hex::encode(hash),
                                pack: pack.to_string(),
                                reason: reason.to_string(),
                            });
                        }
                    },
                };
                let part = chunk.offset as usize..chunk.offset as usize + chunk.len as usize;
                let (pid, addr, _) = verify.memory.chunk_at(i);
                if verify.placer.as_ref().is_some_and(|p| p.place(pid, addr, &whole[part.clone()])) {
                    put_in_place(&verify, i);
                    placed = true;
                } else {
                    // A part is copied out: the cache holds only the bytes it counts.
                    let data = match part == (0..whole.len()) {
                        true => whole.clone(),
                        false => Bytes::copy_from_slice(&whole[part]),
                    };
                    cache(&verify, i, data);
                }
                let left = parts_left.get_mut(&loc.offset).expect("counted");
                *left -= 1;
                if *left > 0 {
                    decoded.insert(loc.offset, whole);
                }
            }
            if placed {
                verify.tell_arrived();
            }
        }
        Ok(())
    })
    .await
    .map_err(|e| LazyFetchError::Task { id: shared.memory.id.clone(), reason: e.to_string() })??;
    debug!(chunks = batch.len(), "lazy restore: chunks cached or put in place");
    Ok(())
}

/// Fetched chunk `i` was put in place by the placer: it leaves the cache's count (its room is
/// the prefetcher's again) and is not fetched again unless asked for.
fn put_in_place(shared: &Shared, i: usize) {
    let mut st = shared.lock();
    st.slots[i] = Slot::Absent;
    st.released[i] = true;
    st.held -= u64::from(shared.memory.chunks[i].len);
    st.placed.push(i);
    drop(st);
    shared.wake.notify_one();
}

/// Puts fetched chunk `i` in the cache, unless it was released meanwhile, and tells the fault
/// server.
fn cache(shared: &Shared, i: usize, data: Bytes) {
    let mut st = shared.lock();
    if st.released[i] {
        // Released while it was fetched, and not asked for since: nobody needs it.
        st.slots[i] = Slot::Absent;
        st.held -= u64::from(shared.memory.chunks[i].len);
        shared.wake.notify_one();
        return;
    }
    st.slots[i] = Slot::Ready(data);
    st.arrived.push(i);
    drop(st);
    shared.tell_arrived();
}
