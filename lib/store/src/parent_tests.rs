//! Dumps tracking dirty pages: runs in parent taken from the previous checkpoint, through the
//! real store, sifted and streamed, against a full dump of the same memory.

use std::collections::HashSet;
use std::path::Path;
use std::sync::Arc;
use std::sync::atomic::{AtomicUsize, Ordering};

use super::*;
use crate::chunks::CHUNK;
use crate::sift::tests::stored_and_restored;
use crate::staging::StagingBudget;
use crate::stream::{BlockPool, stream};
use crate::{DumpPages, Manifest, Sifted, TreeMemory};
use stasis_criu_images::pages::{PAGE_SIZE, PE_LAZY, PE_PARENT, PE_PRESENT, PageSink};

const PAGE: u64 = PAGE_SIZE;
const DST: u64 = (7 << 8) | 1;

/// A task's memory: areas (first address, bytes) in address order, apart.
type Memory = Vec<(u64, Vec<u8>)>;

fn pattern(seed: u64, len: u64) -> Vec<u8> {
    crate::test_checkpoints::noise(len as usize, seed)
}

/// 4 MiB from an aligned address, and 40 pages from an address inside a window.
fn before() -> Memory {
    vec![(0x10000, pattern(1, 64 * CHUNK as u64)), (0x80_0000 + 3 * PAGE, pattern(2, 40 * PAGE))]
}

/// `before` once the tree ran on, and the pages written since (by address): one page in the
/// middle of window 5, all of window 20, a byte of window 40; the first area grown by 20
/// pages (new memory reads as written); pages 10..14 of the second unmapped.
fn after(before: &Memory) -> (Memory, HashSet<u64>) {
    let (mut a, b) = (before[0].clone(), before[1].clone());
    let mut dirty = HashSet::new();
    let mut write = |area: &mut (u64, Vec<u8>), offset: u64, bytes: &[u8]| {
        area.1[offset as usize..offset as usize + bytes.len()].copy_from_slice(bytes);
        let first = offset / PAGE * PAGE;
        (first..offset + bytes.len() as u64).step_by(PAGE as usize).for_each(|p| {
            dirty.insert(area.0 + p);
        });
    };
    let window = CHUNK as u64;
    write(&mut a, 5 * window + 7 * PAGE, &[0xee; PAGE as usize]);
    write(&mut a, 20 * window, &pattern(3, window));
    write(&mut a, 40 * window + 17, &[0x5a]);
    let grown = a.1.len() as u64;
    a.1.extend(vec![0; 20 * PAGE as usize]);
    write(&mut a, grown, &pattern(4, 20 * PAGE));
    let (b1, b2) = (b.1[..(10 * PAGE) as usize].to_vec(), b.1[(14 * PAGE) as usize..].to_vec());
    let memory = vec![a, (b.0, b1), (b.0 + 14 * PAGE, b2)];
    (memory, dirty)
}

/// Sends `memory` as CRIU does, in transfers of at most 17 pages: every page, or with
/// `written`, those pages present and the others in parent. Present pages are marked as ones
/// a lazy restore may leave in the store, as CRIU marks private anonymous memory.
fn send(sink: &mut dyn PageSink, memory: &Memory, written: Option<&HashSet<u64>>) {
    send_by(sink, memory, written, 17);
}

/// [`send`] in transfers of at most `transfer` pages.
fn send_by(sink: &mut dyn PageSink, memory: &Memory, written: Option<&HashSet<u64>>, transfer: u64) {
    sink.open(DST).unwrap();
    for (start, bytes) in memory {
        let present = |page: u64| written.is_none_or(|w| w.contains(&(start + page * PAGE)));
        let pages = bytes.len() as u64 / PAGE;
        let mut first = 0;
        while first < pages {
            let kind = present(first);
            let mut end = first + 1;
            while end < pages && end - first < transfer && present(end) == kind {
                end += 1;
            }
            let vaddr = start + first * PAGE;
            let nr_pages = end - first;
            let run = PageRun {
                dst_id: DST,
                vaddr,
                nr_pages,
                flags: if kind { PE_PRESENT | PE_LAZY } else { PE_PARENT },
            };
            let data = match kind {
                true => &bytes[(first * PAGE) as usize..(end * PAGE) as usize],
                false => &[][..],
            };
            sink.run(run, &mut &data[..]).unwrap();
            first = end;
        }
    }
}

fn whole(memory: &Memory) -> Vec<u8> {
    memory.iter().flat_map(|(_, bytes)| bytes.iter().copied()).collect()
}

/// Pages of `memory` not in `written`, in bytes.
fn unchanged_bytes(memory: &Memory, written: &HashSet<u64>) -> u64 {
    let pages =
        memory.iter().flat_map(|(start, b)| (0..b.len() as u64 / PAGE).map(move |p| start + p * PAGE));
    pages.filter(|p| !written.contains(p)).count() as u64 * PAGE
}

/// An image's runs (address, pages, flags) and chunks (hash, length).
type ImageLayout = (Vec<(u64, u64, u32)>, Vec<(Vec<u8>, u32)>);

/// Runs and chunk hashes: what a restore reads, whatever the references say of freshness.
fn layout(manifest: &Manifest) -> Vec<ImageLayout> {
    let image = |m: &MemoryImage| {
        let runs = m.runs.iter().map(|r| (r.vaddr, r.nr_pages, r.flags)).collect();
        (runs, m.chunks.iter().map(|c| (c.hash.clone(), c.len)).collect())
    };
    manifest.memory.iter().map(image).collect()
}

/// A parent of checkpoint `manifest` read from `store`, counting its chunk reads.
fn counted_parent(store: &Store, manifest: &Manifest, reads: Arc<AtomicUsize>) -> Parent {
    let memory = Arc::new(ParentMemory::new(&manifest.id, &manifest.memory).unwrap());
    assert!(memory.held_by(store));
    let mut read = store.chunk_reader(manifest.id.clone(), Handle::current());
    Parent::new(memory, move |chunk| {
        reads.fetch_add(1, Ordering::SeqCst);
        read(chunk)
    })
}

/// The first, full checkpoint of `before()`, stored and committed.
async fn first_checkpoint(store: &Store, dir: &Path) -> Manifest {
    let (sink, source) = stream(&BlockPool::default());
    let mut sink = sink;
    let storing =
        stored_and_restored(store, dir, DumpPages::Streamed(source, None), "20261127-000000-aaaaaa");
    let sending = tokio::task::spawn_blocking(move || {
        send(&mut sink, &before(), None);
        sink.finish().unwrap();
    });
    let ((manifest, restored), sent) = tokio::join!(storing, sending);
    sent.unwrap();
    assert!(restored == whole(&before()));
    manifest
}

/// A store in a fresh directory holding the first checkpoint of `before()`.
async fn first_stored() -> (tempfile::TempDir, Store, Manifest) {
    let dir = tempfile::tempdir().unwrap();
    let store = Store::in_dir(&dir.path().join("store"));
    let first = first_checkpoint(&store, &dir.path().join("a")).await;
    (dir, store, first)
}

/// `memory` sifted as the tracked dump after `first` that wrote `written` sends it, reading
/// unchanged pages from `tree` if given; with the count of chunks read back from `first`.
async fn sifted_after(
    store: &Store,
    dir: &Path,
    first: &Manifest,
    memory: &Memory,
    written: &HashSet<u64>,
    tree: Option<Box<dyn TreeMemory>>,
) -> (Sifted, usize) {
    let reads = Arc::new(AtomicUsize::new(0));
    let parent = counted_parent(store, first, reads.clone());
    let sifted = sift_tracked(store, dir, parent, memory, written.clone(), tree).await;
    (sifted, reads.load(Ordering::SeqCst))
}

/// Sifts `memory` with `parent` as a tracked dump that wrote `written` sends it, the page server
/// reading unchanged pages from `tree` if given.
async fn sift_tracked(
    store: &Store,
    dir: &Path,
    parent: Parent,
    memory: &Memory,
    written: HashSet<u64>,
    tree: Option<Box<dyn TreeMemory>>,
) -> Sifted {
    let pool = BlockPool::default();
    let previous = parent.memory.clone();
    let (mut sink, sifting) =
        store.sift(&StagingBudget::new(64 << 20), &dir.join("spill"), &pool, 0, Some(parent)).unwrap();
    if let Some(tree) = tree {
        sink = sink.reading_unchanged_from(tree, previous);
    }
    let sent = memory.clone();
    tokio::task::spawn_blocking(move || {
        send(&mut sink, &sent, Some(&written));
        sink.finish().unwrap();
        sifting.finish().unwrap()
    })
    .await
    .unwrap()
}

/// Stores and commits `sifted` as a checkpoint after the first (an id of its own), and checks
/// that it restores `memory` byte for byte.
async fn stored_whole(store: &Store, dir: &Path, sifted: Sifted, memory: &Memory) -> Manifest {
    static NEXT: AtomicUsize = AtomicUsize::new(1);
    let id = format!("20261127-000001-{:06x}", NEXT.fetch_add(1, Ordering::Relaxed));
    let pages = DumpPages::Sifted(Box::new(sifted));
    let (tracked, restored) = stored_and_restored(store, &dir.join("b"), pages, &id).await;
    assert!(restored == whole(memory), "the tracked checkpoint restores byte for byte");
    tracked
}

/// `manifest` restored with all its memory left in the store, and the fetch of that memory
/// started, prefetching up to `prefetch_bytes`.
async fn lazy_fetch(
    store: &Store,
    dir: &Path,
    manifest: &Manifest,
    prefetch_bytes: u64,
) -> (crate::ChunkReader, crate::LazyFetch) {
    let out = dir.join("lazy");
    std::fs::create_dir_all(&out).unwrap();
    let mode = crate::MemoryMode::Lazy { eager: &[] };
    let (_, lazy) = store.materialize_as(manifest, &out, mode, Arc::new(|_, _| {})).await.unwrap();
    let settings = crate::FetchSettings {
        cache_bytes: 2 * prefetch_bytes,
        prefetch_bytes,
        timeout: std::time::Duration::from_secs(10),
        fresh_first: true,
    };
    store.start_lazy_fetch(lazy, settings, true, None).unwrap()
}

/// `manifest`'s memory as a lazy restore serves it, every chunk fetched and verified: the
/// bytes of each area of `like` (a memory with the same areas).
async fn served_lazily(store: &Store, dir: &Path, manifest: &Manifest, like: &Memory) -> Memory {
    let (reader, fetch) = lazy_fetch(store, dir, manifest, 4 << 20).await;
    let mut served: Memory = like.iter().map(|(start, b)| (*start, vec![0xcc; b.len()])).collect();
    let chunks: Vec<(usize, u64, u32)> = reader.memory().task_chunks(DST >> 8).collect();
    for (i, addr, len) in chunks {
        let data = loop {
            if let Some(data) = reader.get(i, crate::Ask::Urgent).unwrap() {
                break data;
            }
            tokio::time::sleep(std::time::Duration::from_millis(2)).await;
        };
        let (start, bytes) =
            served.iter_mut().find(|(start, b)| (*start..start + b.len() as u64).contains(&addr)).unwrap();
        let at = (addr - *start) as usize;
        let place = &mut bytes[at..at + len as usize];
        match data {
            crate::ChunkData::Zero => place.fill(0),
            crate::ChunkData::Bytes(b) => place.copy_from_slice(&b),
        }
        reader.release(i);
    }
    fetch.stop();
    served
}

/// Each reference of image 0: its address, its length, and whether it starts inside its chunk.
fn cuts(manifest: &Manifest) -> Vec<(u64, u32, bool)> {
    let runs = crate::image_runs::image_runs(&manifest.memory[0]).unwrap();
    runs.iter()
        .flat_map(|(run, mine)| chunk_addresses(run, mine).map(|(at, c)| (at, c.len, c.offset != 0)))
        .collect()
}

/// The references of `cut` in the window starting at `window`.
fn in_window(cut: &[(u64, u32, bool)], window: u64) -> Vec<(u64, u32, bool)> {
    cut.iter().filter(|(at, _, _)| (window..window + CHUNK as u64).contains(at)).copied().collect()
}

/// Where window `w` of the first area starts.
fn window(w: u64) -> u64 {
    0x10000 + w * CHUNK as u64
}

#[tokio::test(flavor = "multi_thread")]
async fn a_tracked_dump_references_the_unchanged_part_of_mixed_windows_and_restores_byte_for_byte() {
    let (dir, store, first) = first_stored().await;
    let (memory, written) = after(&before());
    let (sifted, read) = sifted_after(&store, dir.path(), &first, &memory, &written, None).await;
    assert_eq!(sifted.stats().bytes_unchanged, unchanged_bytes(&memory, &written));
    // Nothing is read back: window 5's and window 40's unchanged pages, and the second area's
    // reshaped ones, are parts of chunks the first checkpoint held whole.
    assert_eq!(read, 0, "chunks read back");
    // New: window 5's written page, window 20, window 40's written page, the grown 20 pages.
    assert_eq!(sifted.stats().bytes_new, (1 + 16 + 1 + 20) * PAGE);
    // Parts: windows 5 and 40 but their written pages, the second area's first 10 pages and the
    // 15 of its second stretch that end a window.
    assert_eq!(sifted.stats().bytes_in_part, (15 + 15 + 10 + 15) * PAGE);
    let tracked = stored_whole(&store, dir.path(), sifted, &memory).await;
    let cut = cuts(&tracked);
    let counts = [5, 20, 40].map(|w| in_window(&cut, window(w)).len());
    assert_eq!(counts, [3, 1, 2], "{cut:x?}");
    let rest_of_5 = (window(5) + 8 * PAGE, 8 * PAGE as u32, true);
    assert_eq!(in_window(&cut, window(5))[2], rest_of_5, "window 5's pages after the written one");
    assert!(served_lazily(&store, dir.path(), &tracked, &memory).await == memory, "served lazily");

    // A full dump of the same memory has the same runs (flags included: unchanged pages stay
    // ones a lazy restore leaves in the store), windows 5 and 40 cut by kind.
    let (sink, source) = stream(&BlockPool::default());
    let mut sink = sink;
    let full_dir = dir.path().join("c");
    let storing =
        stored_and_restored(&store, &full_dir, DumpPages::Streamed(source, None), "20261127-000002-cccccc");
    let sent = memory.clone();
    let sending = tokio::task::spawn_blocking(move || {
        send(&mut sink, &sent, None);
        sink.finish().unwrap();
    });
    let ((full, _), sent) = tokio::join!(storing, sending);
    sent.unwrap();
    let runs = |m: &Manifest| layout(m).into_iter().map(|(runs, _)| runs).collect::<Vec<_>>();
    assert_eq!(runs(&tracked), runs(&full));
    assert_eq!(cuts(&tracked).len(), cuts(&full).len() + 3);
}

/// A tracked second checkpoint of `after(before())` on top of `first`, committed: its memory
/// and manifest.
async fn second_stored(store: &Store, dir: &Path, first: &Manifest) -> (Memory, Manifest) {
    let (memory, written) = after(&before());
    let (sifted, _) = sifted_after(store, dir, first, &memory, &written, None).await;
    let second = stored_whole(store, dir, sifted, &memory).await;
    (memory, second)
}

/// `memory` with page 3 of window 5 written (its page 7 was written before the second
/// checkpoint), and that page.
fn window_5_again(memory: &Memory) -> (Memory, HashSet<u64>) {
    let mut memory = memory.clone();
    let at = 5 * CHUNK + 3 * PAGE as usize;
    memory[0].1[at..at + PAGE as usize].fill(0x77);
    let page = memory[0].0 + at as u64;
    (memory, HashSet::from([page]))
}

#[tokio::test(flavor = "multi_thread")]
async fn a_window_written_again_is_read_back_whole_and_references_stay_one_level_deep() {
    let (dir, store, first) = first_stored().await;
    let (memory, second) = second_stored(&store, dir.path(), &first).await;
    let (memory, written) = window_5_again(&memory);
    let third_dir = dir.path().join("third");
    let reads = Arc::new(AtomicUsize::new(0));
    let parent = counted_parent(&store, &second, reads.clone());
    let sifted = sift_tracked(&store, &third_dir, parent, &memory, written, None).await;
    // Window 5 was cut in the second checkpoint: its unchanged pages are read back from the
    // two chunks its three references take (the first checkpoint's, in two parts, and the
    // written page's) and it is one new chunk again; nothing else is read.
    assert_eq!(reads.load(Ordering::SeqCst), 2, "chunks read back");
    assert_eq!((sifted.stats().chunks_new, sifted.stats().bytes_new), (1, CHUNK as u64));
    let pages = DumpPages::Sifted(Box::new(sifted));
    let (third, restored) = stored_and_restored(&store, &third_dir, pages, "20261127-000003-dddddd").await;
    assert!(restored == whole(&memory), "the third checkpoint restores byte for byte");
    let (now, then) = (cuts(&third), cuts(&second));
    assert_eq!(in_window(&now, window(5)), [(window(5), CHUNK as u32, false)], "one chunk again");
    assert_eq!(in_window(&now, window(40)), in_window(&then, window(40)), "an unchanged cut window");
    assert!(served_lazily(&store, &third_dir, &third, &memory).await == memory, "served lazily");
}

/// A stopped tree's memory, as the daemon reads it: `memory` with every byte XORed with `flip`.
struct Tree(Memory, u8);

impl TreeMemory for Tree {
    fn read(&self, dst_id: u64, addr: u64, len: usize) -> Option<Vec<u8>> {
        assert_eq!(dst_id, DST);
        let (start, bytes) =
            self.0.iter().find(|(start, b)| (*start..start + b.len() as u64).contains(&addr))?;
        let at = (addr - start) as usize;
        Some(bytes.get(at..at + len)?.iter().map(|b| b ^ self.1).collect())
    }

    fn still_the_same(&self) -> bool {
        true
    }
}

#[tokio::test(flavor = "multi_thread")]
async fn unchanged_pages_beside_written_ones_come_from_the_stopped_tree_and_only_if_it_matches() {
    let (dir, store, first) = first_stored().await;
    let (memory, second) = second_stored(&store, dir.path(), &first).await;
    let (memory, written) = window_5_again(&memory);
    let tree = Box::new(Tree(memory.clone(), 0));
    let at = dir.path().join("t");
    let (sifted, read) = sifted_after(&store, &at, &second, &memory, &written, Some(tree)).await;
    // The tree is read from once a written page of it matched what CRIU sent (window 5's):
    // window 5's pages after it come from the tree, those before it are read back.
    assert_eq!(sifted.stats().bytes_from_tree, 12 * PAGE);
    assert_eq!(read, 1, "chunks read back");
    stored_whole(&store, &at, sifted, &memory).await;

    // A tree whose memory is not what CRIU sends (another process's): nothing is taken from it.
    let wrong = Box::new(Tree(memory.clone(), 0xff));
    let dir = dir.path().join("wrong");
    let (sifted, read_wrong) = sifted_after(&store, &dir, &second, &memory, &written, Some(wrong)).await;
    assert_eq!(sifted.stats().bytes_from_tree, 0);
    assert_eq!(read_wrong, 2, "read back instead");
    stored_whole(&store, &dir, sifted, &memory).await;
}

#[tokio::test(flavor = "multi_thread")]
async fn the_tree_is_not_read_for_windows_the_previous_checkpoint_held_whole() {
    let (dir, store, first) = first_stored().await;
    let (memory, written) = after(&before());
    let tree = Box::new(Tree(memory.clone(), 0));
    let (sifted, read) = sifted_after(&store, dir.path(), &first, &memory, &written, Some(tree)).await;
    assert_eq!((sifted.stats().bytes_from_tree, read), (0, 0));
    stored_whole(&store, dir.path(), sifted, &memory).await;
}

#[tokio::test(flavor = "multi_thread")]
async fn a_streamed_dump_in_parent_restores_byte_for_byte() {
    let (dir, store, first) = first_stored().await;
    let (memory, written) = after(&before());
    let parent = counted_parent(&store, &first, Arc::new(AtomicUsize::new(0)));
    let (sink, source) = stream(&BlockPool::default());
    let mut sink = sink;
    let tracked_dir = dir.path().join("b");
    let storing = stored_and_restored(
        &store,
        &tracked_dir,
        DumpPages::Streamed(source, Some(parent)),
        "20261127-000001-bbbbbb",
    );
    let sent = memory.clone();
    let sending = tokio::task::spawn_blocking(move || {
        send(&mut sink, &sent, Some(&written));
        sink.finish().unwrap();
    });
    let ((_, restored), sent) = tokio::join!(storing, sending);
    sent.unwrap();
    assert!(restored == whole(&memory));
}

#[tokio::test(flavor = "multi_thread")]
async fn pages_in_parent_that_the_previous_checkpoint_lacks_fail_the_dump() {
    let (dir, store, first) = first_stored().await;
    let parent = counted_parent(&store, &first, Arc::new(AtomicUsize::new(0)));
    let pool = BlockPool::default();
    let spill = dir.path().join("spill");
    let (mut sink, sifting) =
        store.sift(&StagingBudget::new(1 << 20), &spill, &pool, 0, Some(parent)).unwrap();
    let failed = tokio::task::spawn_blocking(move || {
        sink.open(DST).unwrap();
        // Past the first area's end: memory the previous checkpoint never had.
        let run = PageRun { dst_id: DST, vaddr: 0x10000 + 64 * CHUNK as u64, nr_pages: 2, flags: PE_PARENT };
        sink.run(run, &mut &[][..]).unwrap();
        sink.finish().unwrap();
        sifting.finish().unwrap_err()
    })
    .await
    .unwrap();
    assert!(failed.to_string().contains("does not hold the 2 pages"), "{failed}");
}

/// References as (the first byte of the hash, offset, length).
type Described = Vec<(u8, u32, u32)>;

/// References described, and whether they take a part.
fn described(refs: Option<References>) -> Option<(Described, bool)> {
    let (chunks, part) = match refs? {
        References::AsTheyWere(chunks) => (chunks, false),
        References::Part(chunk) => (vec![chunk], true),
    };
    Some((chunks.iter().map(|c| (c.hash.first().copied().unwrap_or(0), c.offset, c.len)).collect(), part))
}

#[test]
fn the_previous_checkpoint_answers_what_it_holds() {
    let chunk =
        |hash: u8, len: u64| ChunkRef { hash: vec![hash; 32], len: len as u32, fresh: true, offset: 0 };
    let runs = vec![
        stasis_proto::stasis::store::v1::PageRun { vaddr: 0x3000, nr_pages: 13, flags: PE_PRESENT },
        stasis_proto::stasis::store::v1::PageRun { vaddr: 0x10000, nr_pages: 7, flags: PE_PRESENT | PE_LAZY },
        stasis_proto::stasis::store::v1::PageRun { vaddr: 0x40000, nr_pages: 1, flags: PE_PRESENT },
    ];
    // 0x3000..0x10000 (13 pages), 0x10000..0x17000 (7 pages), then 0x40000 alone.
    let chunks = vec![chunk(1, 13 * PAGE), chunk(2, 7 * PAGE), chunk(3, PAGE)];
    let image = MemoryImage { dst_id: DST, runs, chunks };
    let memory = ParentMemory::new("c", &[image]).unwrap();
    assert!(memory.has(DST) && !memory.has(DST + 256));
    let run = |vaddr, nr_pages| PageRun { dst_id: DST, vaddr, nr_pages, flags: PE_PARENT };
    assert!(memory.covers(&run(0x3000, 20)));
    assert!(memory.covers(&run(0x5000, 12)));
    assert!(!memory.covers(&run(0x2000, 2)), "before the first page");
    assert!(!memory.covers(&run(0x16000, 2)), "past the run's end");
    assert!(!memory.covers(&run(0x17000, 1)), "in the gap");
    assert!(memory.covers(&run(0x40000, 1)));
    let page = PAGE as u32;
    let refs = |dst, start, end| described(memory.references(dst, start, end));
    assert_eq!(refs(DST, 0x10000, 0x17000), Some((vec![(2, 0, 7 * page)], false)), "a chunk as it was");
    assert_eq!(refs(DST, 0x10000, 0x16000), Some((vec![(2, 0, 6 * page)], true)), "a part of one");
    assert_eq!(refs(DST, 0x4000, 0x10000), Some((vec![(1, page, 12 * page)], true)), "a part from inside");
    assert_eq!(refs(DST, 0x16000, 0x18000), None, "past the run's end");
    // A window a tracked checkpoint cut by kind (unchanged 7 pages, a written one, unchanged
    // 8): its references as they were, alone or together, but no part of a part.
    let cut = vec![chunk(4, 7 * PAGE), chunk(5, PAGE), ChunkRef { offset: 8 * page, ..chunk(4, 8 * PAGE) }];
    let runs =
        vec![stasis_proto::stasis::store::v1::PageRun { vaddr: 0x50000, nr_pages: 16, flags: PE_PRESENT }];
    let cut_memory = ParentMemory::new("d", &[MemoryImage { dst_id: DST, runs, chunks: cut }]).unwrap();
    let refs = |start, end| described(cut_memory.references(DST, start, end));
    let whole = vec![(4, 0, 7 * page), (5, 0, page), (4, 8 * page, 8 * page)];
    assert_eq!(refs(0x50000, 0x60000), Some((whole, false)), "the window as it was");
    assert_eq!(refs(0x57000, 0x58000), Some((vec![(5, 0, page)], false)), "its written page");
    assert_eq!(refs(0x50000, 0x52000), None, "a part of a part");
    assert_eq!(refs(0x59000, 0x60000), None, "a part of a part, from inside");
    let lazy = PE_PRESENT | PE_LAZY;
    assert_eq!(
        memory.flags_over(DST, 0x5000, 0x12000),
        Some(vec![(0x5000, 0x10000, PE_PRESENT), (0x10000, 0x12000, lazy)])
    );
    assert_eq!(memory.flags_over(DST, 0x16000, 0x18000), None, "past the run's end");
}

/// A parent of checkpoint `manifest` whose reads run side by side: `gauge` holds the reads
/// started and not yet waited for, and the most there were at once.
fn gauged_parent(
    store: &Store,
    manifest: &Manifest,
    gauge: Arc<std::sync::Mutex<(usize, usize, usize)>>,
) -> Parent {
    let memory = Arc::new(ParentMemory::new(&manifest.id, &manifest.memory).unwrap());
    let mut read = store.chunk_reader(manifest.id.clone(), Handle::current());
    Parent::new(memory, move |chunk| {
        {
            let mut g = gauge.lock().unwrap();
            g.0 += 1;
            g.1 = g.1.max(g.0);
            g.2 += 1;
        }
        let reading = read(chunk);
        let gauge = gauge.clone();
        Box::new(move || {
            gauge.lock().unwrap().0 -= 1;
            reading()
        })
    })
}

/// One page written in every window of the first area, as a job scattering small writes over
/// its memory does, page `shift` on from window `w`'s page `w % 16`: every window mixes
/// written and unchanged pages.
fn scattered(before: &Memory, shift: usize) -> (Memory, HashSet<u64>) {
    let mut memory = before.clone();
    let mut written = HashSet::new();
    let area = &mut memory[0];
    for window in 0..area.1.len() / CHUNK {
        let at = window * CHUNK + (window + shift) % 16 * PAGE as usize;
        area.1[at..at + 8].copy_from_slice(&(window as u64 ^ 0xabcd ^ shift as u64).to_le_bytes());
        written.insert(area.0 + at as u64);
    }
    (memory, written)
}

/// A tracked checkpoint of `scattered(before(), 0)` on top of `first`, committed (every window
/// of its first area cut by kind), and the memory of a third dump that writes every window
/// again elsewhere, with its pages written.
async fn scattered_twice(store: &Store, dir: &Path, first: &Manifest) -> (Manifest, Memory, HashSet<u64>) {
    let (memory, written) = scattered(&before(), 0);
    let (sifted, read) = sifted_after(store, dir, first, &memory, &written, None).await;
    assert_eq!((read, sifted.stats().bytes_new), (0, 64 * PAGE), "only the written pages are new");
    let second = stored_whole(store, dir, sifted, &memory).await;
    let (memory, written) = scattered(&memory, 8);
    (second, memory, written)
}

#[tokio::test(flavor = "multi_thread")]
async fn the_unchanged_pages_of_windows_written_again_are_read_back_side_by_side() {
    let (dir, store, first) = first_stored().await;
    let (second, memory, written) = scattered_twice(&store, dir.path(), &first).await;
    let gauge = Arc::new(std::sync::Mutex::new((0, 0, 0)));
    let parent = gauged_parent(&store, &second, gauge.clone());
    let third_dir = dir.path().join("third");
    let sifted = sift_tracked(&store, &third_dir, parent, &memory, written, None).await;
    let (_, most_at_once, reads) = *gauge.lock().unwrap();
    // Each of the 64 windows reads the two chunks its references take (its parts share a
    // read), and the reads wait side by side rather than one after another.
    assert_eq!(reads, 128, "chunks read back");
    assert!(most_at_once >= 32, "at most {most_at_once} reads ran at once");
    assert_eq!(sifted.stats().chunks_new, 64, "every window written again is a new chunk");
    stored_whole(&store, &third_dir, sifted, &memory).await;
}

#[tokio::test(flavor = "multi_thread")]
async fn a_failed_read_back_fails_the_dump_naming_it() {
    let (dir, store, first) = first_stored().await;
    let (second, memory, written) = scattered_twice(&store, dir.path(), &first).await;
    let memory_of_second = Arc::new(ParentMemory::new(&second.id, &second.memory).unwrap());
    let parent = Parent::new(memory_of_second, |_| {
        Box::new(|| Err(ParentError::ReadTask("the disk went away".into())))
    });
    let failed = failed_sift(&store, dir.path(), parent, memory, written).await;
    assert!(failed.contains("the disk went away"), "{failed}");
}

/// The error, with its causes, of a tracked dump of `memory` (which wrote `written`) on
/// `parent` that must fail.
async fn failed_sift(
    store: &Store,
    dir: &Path,
    parent: Parent,
    memory: Memory,
    written: HashSet<u64>,
) -> String {
    let pool = BlockPool::default();
    let (mut sink, sifting) =
        store.sift(&StagingBudget::new(64 << 20), &dir.join("spill"), &pool, 0, Some(parent)).unwrap();
    tokio::task::spawn_blocking(move || {
        // The sink may see the store stop taking pages once the sifter failed.
        let sending = std::panic::catch_unwind(std::panic::AssertUnwindSafe(|| {
            send(&mut sink, &memory, Some(&written));
            let _ = sink.finish();
        }));
        drop(sending);
        let failed = sifting.finish().unwrap_err();
        let mut causes = vec![failed.to_string()];
        let mut cause = std::error::Error::source(&failed);
        while let Some(e) = cause {
            causes.push(e.to_string());
            cause = e.source();
        }
        causes.join(": ")
    })
    .await
    .unwrap()
}

/// [`second_stored`]'s manifest (not stored so) with window 5's last part moved past the end
/// of its chunk.
async fn second_past_its_chunk(store: &Store, dir: &Path, first: &Manifest) -> (Memory, Manifest) {
    let (memory, mut second) = second_stored(store, dir, first).await;
    let part = second.memory[0].chunks.iter_mut().find(|c| c.offset != 0).unwrap();
    part.offset += 4096;
    (memory, second)
}

#[tokio::test(flavor = "multi_thread")]
async fn a_previous_checkpoint_whose_reference_reaches_past_its_chunk_fails_the_dump_naming_it() {
    let (dir, store, first) = first_stored().await;
    let (memory, second) = second_past_its_chunk(&store, dir.path(), &first).await;
    // Window 5 written again: the dump reads its parts back.
    let (memory, written) = window_5_again(&memory);
    let parent = counted_parent(&store, &second, Arc::new(AtomicUsize::new(0)));
    let failed = failed_sift(&store, &dir.path().join("third"), parent, memory, written).await;
    assert!(failed.contains("takes bytes") && failed.contains("which has 65536"), "{failed}");
}

#[tokio::test(flavor = "multi_thread")]
async fn a_lazy_prefetch_reads_a_chunk_cut_in_parts_once() {
    let (dir, store, first) = first_stored().await;
    let (memory, second) = second_stored(&store, dir.path(), &first).await;
    let (reader, fetch) = lazy_fetch(&store, dir.path(), &second, 32 << 20).await;
    let lazy = reader.memory();
    let stored: HashSet<(Arc<str>, u64, u32)> = lazy
        .chunks
        .iter()
        .filter_map(|c| c.stored.as_ref().map(|(_, loc)| (loc.pack.clone(), loc.offset, loc.stored_len)))
        .collect();
    let parts = lazy.chunks.iter().filter(|c| c.offset != 0).count();
    assert!(parts >= 2, "windows 5 and 40 are referenced in parts");
    let n = lazy.len();
    for _ in 0..2000 {
        if (0..n).all(|i| reader.peek(i).is_some()) {
            break;
        }
        tokio::time::sleep(std::time::Duration::from_millis(5)).await;
    }
    assert!((0..n).all(|i| reader.peek(i).is_some()), "everything prefetched");
    let distinct: u64 = stored.iter().map(|(_, _, len)| u64::from(*len)).sum();
    assert_eq!(fetch.bytes_fetched(), distinct, "each stored chunk read once");
    // And each part cut from it as its reference says.
    for (i, addr, len) in reader.memory().task_chunks(DST >> 8) {
        let (start, bytes) = memory.iter().find(|(s, b)| (*s..s + b.len() as u64).contains(&addr)).unwrap();
        let want = &bytes[(addr - start) as usize..(addr - start) as usize + len as usize];
        match reader.peek(i).unwrap() {
            crate::ChunkData::Zero => assert!(want.iter().all(|b| *b == 0)),
            crate::ChunkData::Bytes(got) => assert!(got[..] == *want, "chunk {i} at {addr:#x}"),
        }
    }
    fetch.stop();
}

/// The minor format version of checkpoint `id`'s manifest as stored.
async fn format_minor(store: &Store, id: &str) -> u16 {
    let data = store.backend.get(&store.manifest_key(id)).await.unwrap().bytes().await.unwrap();
    u16::from_le_bytes([data[10], data[11]])
}

#[tokio::test(flavor = "multi_thread")]
async fn references_do_not_depend_on_where_criu_split_the_pages_and_parts_make_a_manifest_1_1() {
    let (dir, store, first) = first_stored().await;
    let (memory, written) = after(&before());
    let (sifted, _) = sifted_after(&store, dir.path(), &first, &memory, &written, None).await;
    let by_17 = stored_whole(&store, dir.path(), sifted, &memory).await;
    assert_eq!((format_minor(&store, &first.id).await, format_minor(&store, &by_17.id).await), (0, 1));
    // The same dump in transfers of 3 pages: unchanged runs split inside mixed windows, which
    // the page server joins again before the chunker sees them.
    let parent = counted_parent(&store, &first, Arc::new(AtomicUsize::new(0)));
    let pool = BlockPool::default();
    let spill = dir.path().join("spill-3");
    let (mut sink, sifting) =
        store.sift(&StagingBudget::new(64 << 20), &spill, &pool, 0, Some(parent)).unwrap();
    let sent = memory.clone();
    let sifted = tokio::task::spawn_blocking(move || {
        send_by(&mut sink, &sent, Some(&written), 3);
        sink.finish().unwrap();
        sifting.finish().unwrap()
    })
    .await
    .unwrap();
    let by_3 = stored_whole(&store, &dir.path().join("by-3"), sifted, &memory).await;
    assert_eq!(cuts(&by_3), cuts(&by_17));
}

#[tokio::test(flavor = "multi_thread")]
async fn a_reference_past_its_chunk_is_refused_by_a_restore_and_named_by_the_check() {
    let (dir, store, first) = first_stored().await;
    let (_, mut second) = second_past_its_chunk(&store, dir.path(), &first).await;
    second.id = "20261127-000009-eeeeee".into();
    store.commit(&second, &store.begin_commit().await.unwrap()).await.unwrap();
    let out = dir.path().join("refused");
    std::fs::create_dir_all(&out).unwrap();
    let refused = store.materialize_as(&second, &out, crate::MemoryMode::Eager, Arc::new(|_, _| {})).await;
    let refused = refused.unwrap_err().to_string();
    assert!(refused.contains("takes bytes") && refused.contains("which has 65536"), "{refused}");
    let report = store.check(false).await.unwrap();
    let why = report.broken.get(&second.id).map(|w| w.join("; ")).unwrap_or_default();
    assert!(why.contains("takes bytes"), "{why}");
}
