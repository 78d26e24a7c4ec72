//! The store's side of a lazy restore, without CRIU: memory stored as a dump would be, split
//! into what the images hold and what is served on demand, served verified.

use std::sync::Arc;
use std::time::Duration;

use futures::StreamExt;

use stasis_proto::stasis::store::v1::AddressRange;

use super::{
    Ask, ChunkData, ChunkReader, FetchSettings, LazyFetch, LazyFetchError, LazyMemory, Manifest, MemoryMode,
    Placer, Staging, Store,
};
use stasis_criu_images::pages::{PAGE_SIZE, PE_LAZY, PE_PRESENT, PageRun, PageSink};

use crate::test_checkpoints::noise;

const PID: u64 = 42;
const SETTINGS: FetchSettings = FetchSettings {
    cache_bytes: 1 << 20,
    prefetch_bytes: 1 << 20,
    timeout: Duration::from_secs(10),
    fresh_first: true,
};

/// A store holding one checkpoint of task 42: 40 lazy pages at 0x10000 (two of them zero),
/// 8 lazy pages at 0x100000, and 2 pages that cannot be lazy at 0x200000.
async fn stored(dir: &std::path::Path) -> (Store, Manifest, [Vec<u8>; 3]) {
    let store = Store::in_dir(&dir.join("store"));
    let images = dir.join("images");
    std::fs::create_dir_all(&images).unwrap();
    stasis_criu_images::testing::write_dump_images(&images, PID as u32, &[]);
    let mut a = noise(40 * PAGE_SIZE as usize, 1);
    a[PAGE_SIZE as usize * 16..PAGE_SIZE as usize * 32].fill(0);
    let data = [a, noise(8 * PAGE_SIZE as usize, 2), noise(2 * PAGE_SIZE as usize, 3)];
    let mut staging = Staging::new(&crate::StagingBudget::new(64 << 20), &dir.join("spill"));
    let runs = [(0x10000, PE_PRESENT | PE_LAZY), (0x100000, PE_PRESENT | PE_LAZY), (0x200000, PE_PRESENT)];
    for ((vaddr, flags), bytes) in runs.into_iter().zip(&data) {
        let nr_pages = bytes.len() as u64 / PAGE_SIZE;
        let run = PageRun { dst_id: (PID << 8) | 1, vaddr, nr_pages, flags };
        staging.run(run, &mut bytes.as_slice()).unwrap();
    }
    let staged = Arc::new(staging.finish().unwrap());
    let dump =
        store.store_dump(crate::DumpPages::Staged(staged), &images, &[], Arc::new(|_, _| {})).await.unwrap();
    let manifest = Manifest {
        id: "20261122-000000-abcdef".into(),
        files: dump.files,
        memory: dump.memory,
        ..Default::default()
    };
    (store, manifest, data)
}

#[tokio::test(flavor = "multi_thread")]
async fn lazy_memory_is_left_in_the_store_and_served_verified() {
    let dir = tempfile::tempdir().unwrap();
    let (store, manifest, [a, b, c]) = stored(dir.path()).await;
    let out = dir.path().join("restore");
    std::fs::create_dir_all(&out).unwrap();
    // The second run overlaps recorded GPU host memory: it must be restored eagerly.
    let eager = [AddressRange { pid: PID as i32, start: 0x101000, end: 0x102000 }];
    let mode = MemoryMode::Lazy { eager: &eager };
    let (_, memory) = store.materialize_as(&manifest, &out, mode, Arc::new(|_, _| {})).await.unwrap();
    assert_eq!(memory.bytes(), a.len() as u64, "only the first run is left lazy");
    assert_eq!(std::fs::read(out.join("pages-1.img")).unwrap(), [b.as_slice(), c.as_slice()].concat());
    let core = std::fs::read(dir.path().join("images/core-42.img")).unwrap();
    assert_eq!(std::fs::read(out.join("core-42.img")).unwrap(), core);

    let (reader, fetch) = store.start_lazy_fetch(memory, SETTINGS, true, None).unwrap();
    let memory = reader.memory();
    let chunks: Vec<(usize, u64, u32)> = memory.task_chunks(PID).collect();
    assert_eq!(chunks.iter().map(|c| u64::from(c.2)).sum::<u64>(), a.len() as u64);
    assert_eq!(chunks[0].1, 0x10000);
    assert_eq!(
        memory.locate(PID, 0x10000 + 5 * PAGE_SIZE).map(|(i, offset, _)| (i, offset)),
        Some((0, 5 * PAGE_SIZE))
    );
    assert_eq!(memory.locate(PID, 0x100000), None, "restored eagerly, not served");
    // A fault's chunk first, then the rest; zero chunks need no fetch.
    let (first, _, _) = chunks[1];
    wait_for(&reader, first).await;
    let mut all = vec![0u8; a.len()];
    for (i, addr, len) in chunks {
        let data = wait_for(&reader, i).await;
        let at = (addr - 0x10000) as usize;
        match data {
            ChunkData::Zero => assert!(a[at..at + len as usize].iter().all(|b| *b == 0)),
            ChunkData::Bytes(bytes) => all[at..at + len as usize].copy_from_slice(&bytes),
        }
        reader.release(i);
        assert!(
            reader.peek(i).is_none_or(|d| matches!(d, ChunkData::Zero)),
            "a released chunk leaves the cache"
        );
    }
    assert_eq!(all, a, "served memory differs");
    assert!(fetch.bytes_fetched() > 0);
    fetch.stop();
    assert!(matches!(reader.get(first, Ask::Urgent), Err(LazyFetchError::Stopped)));
}

/// Chunk `i`, once it arrived (asked for at once).
async fn wait_for(reader: &ChunkReader, i: usize) -> ChunkData {
    for _ in 0..1000 {
        if let Some(data) = reader.get(i, Ask::Urgent).unwrap() {
            return data;
        }
        tokio::time::sleep(Duration::from_millis(5)).await;
    }
    panic!("chunk {i} never arrived");
}

/// The stored checkpoint, restored with all of its lazy memory left in the store, and the
/// memory stored (as [`stored`] gives it).
async fn all_lazy(dir: &std::path::Path) -> (Store, LazyMemory, [Vec<u8>; 3]) {
    let (store, manifest, data) = stored(dir).await;
    let out = dir.join("restore");
    std::fs::create_dir_all(&out).unwrap();
    let mode = MemoryMode::Lazy { eager: &[] };
    let (_, memory) = store.materialize_as(&manifest, &out, mode, Arc::new(|_, _| {})).await.unwrap();
    (store, memory, data)
}

/// Chunk `i` as cached, once it arrived, without asking for it.
async fn arrival(reader: &ChunkReader, i: usize, within: Duration) -> Option<ChunkData> {
    let deadline = tokio::time::Instant::now() + within;
    while tokio::time::Instant::now() < deadline {
        if let Some(data) = reader.peek(i) {
            return Some(data);
        }
        tokio::time::sleep(Duration::from_millis(5)).await;
    }
    None
}

/// The stored checkpoint served lazily with room for one full chunk (64 KiB) and no prefetch
/// (only what is asked for), and its three chunks that hold data: 64, 32 and 32 KiB.
async fn one_chunk_of_room(dir: &std::path::Path) -> (ChunkReader, LazyFetch, [usize; 3]) {
    let (store, memory, _) = all_lazy(dir).await;
    let settings = FetchSettings { cache_bytes: 64 << 10, ..SETTINGS };
    let (reader, fetch) = store.start_lazy_fetch(memory, settings, false, None).unwrap();
    let stored: Vec<usize> =
        reader.memory().task_chunks(PID).map(|(i, _, _)| i).filter(|&i| reader.peek(i).is_none()).collect();
    let chunks = stored[..].try_into().unwrap_or_else(|_| panic!("chunks with data: {stored:?}"));
    (reader, fetch, chunks)
}

#[tokio::test(flavor = "multi_thread")]
async fn a_chunk_cut_from_a_larger_download_is_cached_as_a_copy_of_its_bytes() {
    use object_store::ObjectStore;
    let dir = tempfile::tempdir().unwrap();
    let (files, manifest, [a, _, _]) = stored(dir.path()).await;
    // The same objects in memory, where each range read is a slice of the whole object, as a
    // remote store's are slices of a download that merged nearby ranges: a chunk cached as
    // such a slice would hold all of the download in memory, counted as its own bytes only.
    // The store is even said to read ranges apart, as a local one does: the slices must still
    // be told from buffers of their own.
    let objects = Arc::new(object_store::memory::InMemory::new());
    let listed: Vec<_> = files.backend.list(None).map(|m| m.unwrap().location).collect().await;
    for key in listed {
        let data = files.backend.get(&key).await.unwrap().bytes().await.unwrap();
        objects.put(&key, data.into()).await.unwrap();
    }
    let store = Store { reads_apart: true, ..Store::from_backend(objects.clone(), Default::default()) };
    let out = dir.path().join("restore");
    std::fs::create_dir_all(&out).unwrap();
    let mode = MemoryMode::Lazy { eager: &[] };
    let (_, memory) = store.materialize_as(&manifest, &out, mode, Arc::new(|_, _| {})).await.unwrap();
    let (reader, fetch) = store.start_lazy_fetch(memory, SETTINGS, true, None).unwrap();
    // The first run's chunks (random data: stored as it is).
    let end = 0x10000 + a.len() as u64;
    let chunks: Vec<(usize, u64, u32)> = reader.memory().task_chunks(PID).filter(|c| c.1 < end).collect();
    let mut raw = 0;
    for (i, addr, len) in chunks {
        let ChunkData::Bytes(cached) = wait_for(&reader, i).await else { continue };
        let at = (addr - 0x10000) as usize;
        assert_eq!(cached[..], a[at..at + len as usize], "chunk {i}");
        let (_, loc) = reader.memory().chunks[i].stored.clone().unwrap();
        let key = store.pack_key(&loc.pack);
        let size = objects.head(&key).await.unwrap().size;
        let pack = objects.get_range(&key, 0..size).await.unwrap();
        assert!(
            !pack.as_ptr_range().contains(&cached.as_ptr()),
            "chunk {i} is cached inside its pack's read"
        );
        raw += 1;
    }
    assert!(raw > 0, "no chunk with data");
    fetch.stop();
}

#[tokio::test(flavor = "multi_thread")]
async fn chunks_asked_for_ahead_wait_for_room_in_the_cache_and_a_fault_does_not() {
    let dir = tempfile::tempdir().unwrap();
    let (reader, fetch, [full, ahead, fault]) = one_chunk_of_room(dir.path()).await;
    reader.get(full, Ask::Soon).unwrap();
    reader.get(ahead, Ask::Soon).unwrap();
    assert!(arrival(&reader, full, Duration::from_secs(5)).await.is_some(), "the first fits");
    assert!(
        arrival(&reader, ahead, Duration::from_millis(300)).await.is_none(),
        "a chunk asked for ahead was fetched into a full cache"
    );
    // A fault's chunk is fetched however full the cache is.
    assert!(matches!(wait_for(&reader, fault).await, ChunkData::Bytes(_)));
    // Once the first leaves the cache there is room again.
    reader.release(full);
    assert!(arrival(&reader, ahead, Duration::from_secs(5)).await.is_some(), "it never came");
    fetch.stop();
}

#[tokio::test(flavor = "multi_thread")]
async fn the_prefetch_fills_only_its_share_of_the_cache() {
    let dir = tempfile::tempdir().unwrap();
    let (store, memory, _) = all_lazy(dir.path()).await;
    // The chunks that hold data (64, 32 and 32 KiB), in the prefetcher's order.
    let stored: Vec<usize> = (0..memory.len()).filter(|&i| memory.chunks[i].stored.is_some()).collect();
    let [first, second, third] = stored[..].try_into().unwrap();
    // Room for all of them, of which one chunk's for the prefetcher's own order.
    let settings = FetchSettings { prefetch_bytes: 64 << 10, ..SETTINGS };
    let (reader, fetch) = store.start_lazy_fetch(memory, settings, true, None).unwrap();
    assert!(arrival(&reader, first, Duration::from_secs(5)).await.is_some(), "nothing prefetched");
    assert!(
        arrival(&reader, second, Duration::from_millis(300)).await.is_none(),
        "the prefetch went on past its share of the cache"
    );
    // Chunks asked for have the rest of it.
    reader.get(third, Ask::Soon).unwrap();
    assert!(arrival(&reader, third, Duration::from_secs(5)).await.is_some(), "a chunk asked for never came");
    // Once the first is in place (released), the prefetch goes on.
    reader.release(first);
    assert!(arrival(&reader, second, Duration::from_secs(5)).await.is_some(), "the prefetch stopped");
    fetch.stop();
}

#[tokio::test(flavor = "multi_thread")]
async fn a_chunk_released_while_it_is_fetched_does_not_stay_in_the_cache() {
    let dir = tempfile::tempdir().unwrap();
    let (reader, fetch, [full, ahead, _]) = one_chunk_of_room(dir.path()).await;
    // Asked for, then not needed any more (its process dropped that memory) before it came.
    reader.get(full, Ask::Soon).unwrap();
    reader.release(full);
    reader.get(ahead, Ask::Soon).unwrap();
    assert!(
        arrival(&reader, ahead, Duration::from_secs(5)).await.is_some(),
        "the released chunk kept the cache full"
    );
    // Asked for again, it is fetched and kept.
    assert!(matches!(wait_for(&reader, full).await, ChunkData::Bytes(_)));
    fetch.stop();
}

/// A placer that takes every chunk but the one at `refused`, and keeps what it took: task,
/// address, bytes.
struct Taker {
    refused: u64,
    took: std::sync::Mutex<Vec<(u64, u64, Vec<u8>)>>,
}

impl Placer for Taker {
    fn place(&self, pid: u64, addr: u64, bytes: &[u8]) -> bool {
        if addr == self.refused {
            return false;
        }
        self.took.lock().unwrap().push((pid, addr, bytes.to_vec()));
        true
    }
}

impl Taker {
    fn refusing(refused: u64) -> Arc<Taker> {
        Arc::new(Taker { refused, took: Default::default() })
    }
}

#[tokio::test(flavor = "multi_thread")]
async fn chunks_a_placer_takes_skip_the_cache_and_free_its_room_and_the_others_are_cached() {
    let dir = tempfile::tempdir().unwrap();
    let (store, memory, [a, b, _]) = all_lazy(dir.path()).await;
    // Its chunks with data, in the prefetch order (address order: all are new): 64 KiB at
    // 0x10000, 32 KiB at 0x30000 (the placer refuses it) and 32 KiB at 0x100000. The cache has
    // room for the first alone: the others come only if what the placer took left it.
    let taker = Taker::refusing(0x30000);
    let settings = FetchSettings { cache_bytes: 64 << 10, prefetch_bytes: 64 << 10, ..SETTINGS };
    let (reader, fetch) = store.start_lazy_fetch(memory, settings, true, Some(taker.clone())).unwrap();
    let index_at = |addr: u64| reader.memory().task_chunks(PID).find(|c| c.1 == addr).unwrap().0;
    let refused = index_at(0x30000);
    let cached = arrival(&reader, refused, Duration::from_secs(5)).await;
    let Some(ChunkData::Bytes(cached)) = cached else {
        panic!("the refused chunk was not cached: {cached:?}")
    };
    assert_eq!(cached[..], a[0x20000..0x28000]);
    let mut placed = Vec::new();
    for _ in 0..1000 {
        placed.extend(reader.take_placed());
        if placed.len() == 2 {
            break;
        }
        tokio::time::sleep(Duration::from_millis(5)).await;
    }
    placed.sort();
    assert_eq!(placed, [index_at(0x10000), index_at(0x100000)], "what the placer took, told");
    let mut took = taker.took.lock().unwrap().clone();
    took.sort();
    assert_eq!(took, [(PID, 0x10000, a[..0x10000].to_vec()), (PID, 0x100000, b)], "what it was given");
    for i in placed {
        assert!(reader.peek(i).is_none(), "chunk {i}, put in place, is cached too");
    }
    fetch.stop();
}

#[tokio::test(flavor = "multi_thread")]
async fn a_damaged_chunk_never_reaches_the_placer() {
    let dir = tempfile::tempdir().unwrap();
    let (store, memory, _) = all_lazy(dir.path()).await;
    for path in
        walk(&dir.path().join("store")).into_iter().filter(|p| p.extension().is_some_and(|e| e == "pack"))
    {
        let mut data = std::fs::read(&path).unwrap();
        data.iter_mut().for_each(|b| *b ^= 0x5a);
        std::fs::write(&path, data).unwrap();
    }
    let taker = Taker::refusing(0);
    let (reader, fetch) = store.start_lazy_fetch(memory, SETTINGS, true, Some(taker.clone())).unwrap();
    let mut failure = None;
    for _ in 0..1000 {
        failure = reader.failure();
        if failure.is_some() {
            break;
        }
        tokio::time::sleep(Duration::from_millis(5)).await;
    }
    assert!(matches!(failure, Some(LazyFetchError::Corrupt { .. })), "{failure:?}");
    assert!(taker.took.lock().unwrap().is_empty(), "damaged memory was put in place");
    assert!(reader.take_placed().is_empty());
    fetch.stop();
}

/// Restores the stored checkpoint lazily, lets `damage` act on the store directory once the
/// tree would run, and returns the error the first chunk asked for gives.
async fn first_read_after(damage: impl FnOnce(&std::path::Path)) -> LazyFetchError {
    let dir = tempfile::tempdir().unwrap();
    let (store, memory, _) = all_lazy(dir.path()).await;
    damage(&dir.path().join("store"));
    let (reader, fetch) = store.start_lazy_fetch(memory, SETTINGS, false, None).unwrap();
    let first = reader.memory().task_chunks(PID).next().unwrap().0;
    let mut err = None;
    for _ in 0..1000 {
        if let Err(e) = reader.get(first, Ask::Urgent) {
            err = Some(e);
            break;
        }
        tokio::time::sleep(Duration::from_millis(5)).await;
    }
    fetch.stop();
    err.expect("the fetch fails")
}

#[tokio::test(flavor = "multi_thread")]
async fn memory_damaged_in_the_store_fails_the_read_instead_of_being_served() {
    // The packs are damaged after the tree started (bit rot, a bad disk, a tampered bucket).
    let err = first_read_after(|store| {
        for path in walk(store).into_iter().filter(|p| p.extension().is_some_and(|e| e == "pack")) {
            let mut data = std::fs::read(&path).unwrap();
            data.iter_mut().for_each(|b| *b ^= 0x5a);
            std::fs::write(&path, data).unwrap();
        }
    })
    .await;
    assert!(
        matches!(&err, LazyFetchError::Corrupt { .. }) && err.to_string().contains("is corrupted"),
        "{err}"
    );
}

#[tokio::test(flavor = "multi_thread")]
async fn memory_missing_from_the_store_fails_the_read() {
    let err = first_read_after(|store| std::fs::remove_dir_all(store).unwrap()).await;
    assert!(
        matches!(&err, LazyFetchError::Store { .. }) && stasis_errors::error_chain(&err).contains("missing"),
        "{}",
        stasis_errors::error_chain(&err)
    );
}

fn walk(dir: &std::path::Path) -> Vec<std::path::PathBuf> {
    let mut out = Vec::new();
    for entry in std::fs::read_dir(dir).unwrap().flatten() {
        let path = entry.path();
        if path.is_dir() { out.extend(walk(&path)) } else { out.push(path) }
    }
    out
}
