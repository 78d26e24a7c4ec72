//! Serving lazily restored memory: a bounded cache of fetched chunks, filled by a prefetcher
//! task in [`LazyMemory::prefetch_order`] and on demand, and read by the page server.
//!
//! ```text
//! page server (blocking thread)          prefetcher (async task)
//!   read(pid, addr) -> chunk missing  ──urgent──▶  fetch it (and the rest of the request)
//!   waits (at most the timeout)      ◀──ready───   decompress, verify, insert
//!   copies, marks the pages served                 otherwise: next chunks in prefetch order
//!   fully served chunk leaves the cache            while cache + in flight < capacity
//! ```
//! Every chunk is checked against its hash before it is served. A fetch that fails, or takes
//! longer than the timeout, fails the whole session: the caller must then kill the tree,
//! whose memory can no longer be completed.

use std::collections::{HashMap, VecDeque};
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Condvar, Mutex, MutexGuard};
use std::time::{Duration, Instant};

use futures::StreamExt;
use futures::stream::FuturesUnordered;
use tokio::sync::Notify;
use tracing::{debug, warn};

use super::assemble::decode_chunk;
use super::lazy_memory::LazyMemory;
use super::{Store, StoreError};

/// Chunks a fault or a CRIU request waits for are fetched in batches of at most this much
/// (about one CRIU background request)...
const URGENT_BATCH_BYTES: u64 = 4 << 20;
/// ...and prefetched in batches of this much: fewer, larger range reads (each is a request to
/// the store; object_store merges adjacent ranges of a pack into one).
const PREFETCH_BATCH_BYTES: u64 = 16 << 20;
/// Batches fetched at the same time.
const BATCHES_IN_FLIGHT: usize = 4;

/// How a lazy restore fetches memory.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct FetchSettings {
    /// Bytes of fetched memory not yet served that may be held.
    pub cache_bytes: u64,
    /// How long a read waits for the store before the session fails.
    pub timeout: Duration,
    /// Prefetch the chunks new in the checkpoint first (else in address order only).
    pub fresh_first: bool,
}

/// Serving lazily restored memory failed.
#[derive(Debug, Clone, thiserror::Error)]
pub enum LazyFetchError {
    #[error("pages at {vaddr:#x} of pid {pid} were asked for, but the checkpoint restores none there lazily")]
    NotLazy { pid: u64, vaddr: u64 },
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
    /// Not in the cache (not fetched yet, or fully served and dropped).
    Absent,
    Fetching,
    Ready(Arc<Vec<u8>>),
}

struct State {
    slots: Vec<Slot>,
    /// Pages of each chunk served since it was last fetched, a bit each (a chunk is at most
    /// 64 KiB: 16 pages). A page asked for twice (a forked child's copy) counts once.
    served: Vec<u16>,
    /// Bytes held in `Ready` slots and in flight.
    held: u64,
    urgent: VecDeque<usize>,
    failure: Option<LazyFetchError>,
    stopped: bool,
}

struct Shared {
    memory: LazyMemory,
    state: Mutex<State>,
    ready: Condvar,
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
        self.ready.notify_all();
        self.wake.notify_one();
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

/// The page server's side: reads pages, waiting for their chunks when needed.
pub struct LazyReader {
    shared: Arc<Shared>,
    timeout: Duration,
}

impl Store {
    /// Starts serving `memory`: a prefetcher task that keeps at most `settings.cache_bytes`
    /// of chunks not yet served, and a reader that waits at most `settings.timeout` for one.
    pub fn start_lazy_fetch(&self, memory: LazyMemory, settings: FetchSettings) -> (LazyReader, LazyFetch) {
        let n = memory.chunks.len();
        let state = State {
            slots: vec![Slot::Absent; n],
            served: vec![0; n],
            held: 0,
            urgent: VecDeque::new(),
            failure: None,
            stopped: false,
        };
        let shared = Arc::new(Shared {
            memory,
            state: Mutex::new(state),
            ready: Condvar::new(),
            wake: Notify::new(),
            fetched: AtomicU64::new(0),
        });
        tokio::spawn(prefetch(self.clone(), shared.clone(), settings));
        (LazyReader { shared: shared.clone(), timeout: settings.timeout }, LazyFetch { shared })
    }
}

impl LazyReader {
    /// Appends the bytes of task `pid` from `vaddr` on to `out`: at most `max_bytes`, at
    /// least the rest of the chunk holding `vaddr` (or up to `max_bytes`), more where the
    /// following chunks are already in the cache.
    pub fn read(
        &self,
        pid: u64,
        vaddr: u64,
        max_bytes: u64,
        out: &mut Vec<u8>,
    ) -> Result<(), LazyFetchError> {
        let memory = &self.shared.memory;
        let (first, offset, run_end) =
            memory.locate(pid, vaddr).ok_or(LazyFetchError::NotLazy { pid, vaddr })?;
        let want = max_bytes.min(run_end - vaddr);
        let deadline = Instant::now().checked_add(self.timeout).unwrap_or_else(far_future);
        let mut st = self.shared.lock();
        // Ask for every chunk of the request that is missing; the first one goes ahead of
        // everything asked for before (a duplicate entry is skipped when its turn comes).
        let (mut i, mut span) = (first, 0u64);
        while span < want + offset && i < memory.chunks.len() {
            if memory.chunks[i].stored.is_some() && matches!(st.slots[i], Slot::Absent) {
                if i == first {
                    st.urgent.push_front(i);
                } else {
                    st.urgent.push_back(i);
                }
            }
            span += u64::from(memory.chunks[i].len);
            i += 1;
        }
        self.shared.wake.notify_one();
        loop {
            if let Some(e) = &st.failure {
                return Err(e.clone());
            }
            let stored = memory.chunks[first].stored.is_some();
            if !stored || matches!(st.slots[first], Slot::Ready(_)) {
                break;
            }
            if matches!(st.slots[first], Slot::Absent) && !st.urgent.contains(&first) {
                st.urgent.push_front(first);
                self.shared.wake.notify_one();
            }
            let left = deadline.saturating_duration_since(Instant::now());
            if left.is_zero() {
                let secs = self.timeout.as_secs();
                let error = LazyFetchError::Timeout { id: memory.id.clone(), secs };
                drop(st);
                self.shared.fail(error.clone());
                return Err(error);
            }
            st = self.shared.ready.wait_timeout(st, left).unwrap_or_else(|p| p.into_inner()).0;
        }
        let (mut i, mut offset, start) = (first, offset, out.len());
        while ((out.len() - start) as u64) < want && i < memory.chunks.len() {
            let len = u64::from(memory.chunks[i].len);
            let take = (len - offset).min(want - (out.len() - start) as u64);
            match (&memory.chunks[i].stored, &st.slots[i]) {
                (None, _) => out.resize(out.len() + take as usize, 0),
                (Some(_), Slot::Ready(data)) => {
                    out.extend_from_slice(&data[offset as usize..(offset + take) as usize])
                }
                _ => break,
            }
            st.served[i] |= page_bits(offset, take);
            if st.served[i] == page_bits(0, len) && matches!(st.slots[i], Slot::Ready(_)) {
                st.slots[i] = Slot::Absent;
                st.held -= len;
                self.shared.wake.notify_one();
            }
            (i, offset) = (i + 1, 0);
        }
        Ok(())
    }
}

/// The prefetcher: urgent chunks first, then the prefetch order while there is room.
async fn prefetch(store: Store, shared: Arc<Shared>, settings: FetchSettings) {
    let FetchSettings { cache_bytes: capacity, timeout, fresh_first } = settings;
    let order = shared.memory.prefetch_order(fresh_first);
    let mut cursor = 0usize;
    let mut in_flight = FuturesUnordered::new();
    loop {
        loop {
            // Chunks something waits for get a batch of their own even when prefetches fill
            // every slot.
            let urgent = !shared.lock().urgent.is_empty();
            if in_flight.len() >= BATCHES_IN_FLIGHT + usize::from(urgent) {
                break;
            }
            let batch = next_batch(&shared, &order, &mut cursor, capacity);
            if batch.is_empty() {
                break;
            }
            in_flight.push(fetch_batch(store.clone(), shared.clone(), batch, timeout));
        }
        let (done, stopped) = {
            let st = shared.lock();
            (st.failure.is_some(), st.stopped)
        };
        if done || stopped {
            return;
        }
        if cursor >= order.len() && in_flight.is_empty() && shared.lock().urgent.is_empty() {
            // Everything was prefetched once; only refetches of dropped chunks remain.
            shared.wake.notified().await;
            continue;
        }
        tokio::select! {
            Some(result) = in_flight.next() => {
                if let Err(e) = result {
                    warn!(error = %e, "lazy restore: fetching memory failed");
                    shared.fail(e);
                }
            }
            () = shared.wake.notified() => {}
        }
    }
}

/// Picks the next chunks to fetch and marks them `Fetching`.
fn next_batch(shared: &Shared, order: &[usize], cursor: &mut usize, capacity: u64) -> Vec<usize> {
    let chunks = &shared.memory.chunks;
    let mut st = shared.lock();
    let (mut batch, mut bytes) = (Vec::new(), 0u64);
    while bytes < URGENT_BATCH_BYTES {
        let Some(i) = st.urgent.pop_front() else { break };
        if matches!(st.slots[i], Slot::Absent) {
            st.slots[i] = Slot::Fetching;
            bytes += u64::from(chunks[i].len);
            batch.push(i);
        }
    }
    // Urgent chunks go alone, so that they arrive as soon as possible.
    let limit = if batch.is_empty() { PREFETCH_BATCH_BYTES } else { 0 };
    while bytes < limit && *cursor < order.len() && st.held + bytes < capacity {
        let i = order[*cursor];
        *cursor += 1;
        if matches!(st.slots[i], Slot::Absent) && st.served[i] == 0 {
            st.slots[i] = Slot::Fetching;
            bytes += u64::from(chunks[i].len);
            batch.push(i);
        }
    }
    st.held += bytes;
    batch
}

/// Fetches `batch` (grouped by pack, ranges read in one request per pack), verifies each
/// chunk and puts it in the cache.
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
            let ranges: Vec<std::ops::Range<u64>> = chunks
                .iter()
                .map(|&i| {
                    let (_, loc) = shared.memory.chunks[i].stored.as_ref().expect("stored");
                    loc.offset..loc.offset + u64::from(loc.stored_len)
                })
                .collect();
            let blobs = store.read_ranges(&shared.memory.id, &pack, &ranges).await?;
            Ok::<_, StoreError>((pack, chunks, blobs))
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
    let decoded = tokio::task::spawn_blocking(move || {
        let mut out = Vec::new();
        for (pack, chunks, blobs) in fetched {
            for (i, blob) in chunks.into_iter().zip(blobs) {
                let (hash, loc) = verify.memory.chunks[i].stored.as_ref().expect("stored");
                verify.fetched.fetch_add(blob.len() as u64, Ordering::Relaxed);
                let data = decode_chunk(&blob, loc, hash, cipher.as_deref()).map_err(|reason| {
                    LazyFetchError::Corrupt {
                        id: verify.memory.id.clone(),
                        chunk: hex::encode(hash),
                        pack: pack.to_string(),
                        reason: reason.to_string(),
                    }
                })?;
                out.push((i, Arc::new(data)));
            }
        }
        Ok(out)
    })
    .await
    .map_err(|e| LazyFetchError::Task { id: shared.memory.id.clone(), reason: e.to_string() })??;
    let mut st = shared.lock();
    for (i, data) in decoded {
        st.served[i] = 0;
        st.slots[i] = Slot::Ready(data);
    }
    drop(st);
    debug!(chunks = batch.len(), "lazy restore: chunks cached");
    shared.ready.notify_all();
    Ok(())
}

/// A deadline that never comes, for timeouts too large to add to now.
fn far_future() -> Instant {
    Instant::now() + Duration::from_secs(100 * 365 * 86_400)
}

// A chunk's pages fit the bits of `State::served`.
const _: () = assert!(super::CHUNK as u64 / crate::criu::pageserver::PAGE_SIZE <= 16);

/// The bits of the pages in `[offset, offset + len)` of a chunk.
fn page_bits(offset: u64, len: u64) -> u16 {
    let page = crate::criu::pageserver::PAGE_SIZE;
    let (first, end) = (offset / page, (offset + len).div_ceil(page).min(16));
    (first..end).fold(0, |bits, p| bits | (1 << p))
}

#[cfg(test)]
mod tests {
    use super::page_bits;

    #[test]
    fn page_bits_cover_the_pages_touched() {
        assert_eq!(page_bits(0, 65536), u16::MAX);
        assert_eq!(page_bits(4096, 8192), 0b110);
        assert_eq!(page_bits(0, 4096) | page_bits(4096, 61440), u16::MAX);
        assert_eq!(page_bits(0, 12288), 0b111, "a short chunk of three pages");
    }
}
