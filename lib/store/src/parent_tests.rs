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
    crate::lazy_memory_tests::bytes(len as usize, seed)
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
    sink.open(DST).unwrap();
    for (start, bytes) in memory {
        let present = |page: u64| written.is_none_or(|w| w.contains(&(start + page * PAGE)));
        let pages = bytes.len() as u64 / PAGE;
        let mut first = 0;
        while first < pages {
            let kind = present(first);
            let mut end = first + 1;
            while end < pages && end - first < 17 && present(end) == kind {
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
    let (mut sink, sifting) =
        store.sift(&StagingBudget::new(64 << 20), &dir.join("spill"), &pool, 0, Some(parent)).unwrap();
    if let Some(tree) = tree {
        sink = sink.reading_unchanged_from(tree);
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

/// Stores and commits `sifted` as the second checkpoint, and checks that it restores `memory`
/// byte for byte.
async fn stored_whole(store: &Store, dir: &Path, sifted: Sifted, memory: &Memory) -> Manifest {
    let pages = DumpPages::Sifted(Box::new(sifted));
    let (tracked, restored) =
        stored_and_restored(store, &dir.join("b"), pages, "20261127-000001-bbbbbb").await;
    assert!(restored == whole(memory), "the tracked checkpoint restores byte for byte");
    tracked
}

#[tokio::test(flavor = "multi_thread")]
async fn a_sifted_dump_in_parent_restores_what_a_full_one_does_reading_back_only_mixed_windows() {
    let (dir, store, first) = first_stored().await;
    let (memory, written) = after(&before());
    let (sifted, read) = sifted_after(&store, dir.path(), &first, &memory, &written, None).await;
    assert_eq!(sifted.stats().bytes_unchanged, unchanged_bytes(&memory, &written));
    // Window 5 (a page written inside it), the second area's two reshaped chunks; window 40's
    // written page leaves its unchanged neighbours in the same chunk.
    assert!((1..=6).contains(&read), "{read} chunks read back of {}", first.memory[0].chunks.len());
    let tracked = stored_whole(&store, dir.path(), sifted, &memory).await;

    // A full dump of the same memory: the same runs (flags included: unchanged pages stay
    // ones a lazy restore leaves in the store) and chunks.
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
    assert_eq!(layout(&tracked), layout(&full));
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
    let (memory, written) = after(&before());
    let tree = Box::new(Tree(memory.clone(), 0));
    let (sifted, read) = sifted_after(&store, dir.path(), &first, &memory, &written, Some(tree)).await;
    // The tree is read from once a written page of it matched what CRIU sent (window 5's):
    // window 5's pages after it and window 40's after its first come from the tree. What is left
    // to read back: window 5's pages before its written one, the second area's reshaped chunks.
    assert_eq!(sifted.stats().bytes_from_tree, (8 + 15) * PAGE);
    assert!(read <= 3, "{read} chunks read back");
    stored_whole(&store, dir.path(), sifted, &memory).await;

    // A tree whose memory is not what CRIU sends (another process's): nothing is taken from it.
    let wrong = Box::new(Tree(memory.clone(), 0xff));
    let dir = dir.path().join("wrong");
    let (sifted, read_wrong) = sifted_after(&store, &dir, &first, &memory, &written, Some(wrong)).await;
    assert_eq!(sifted.stats().bytes_from_tree, 0);
    assert!(read_wrong > read, "read back instead");
    stored_whole(&store, &dir, sifted, &memory).await;
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

#[test]
fn the_previous_checkpoint_answers_what_it_holds() {
    let chunk = |hash: u8, len: u64| ChunkRef { hash: vec![hash; 32], len: len as u32, fresh: true };
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
    assert_eq!(memory.exact(DST, 0x10000, 0x17000).map(|c| c.hash[0]), Some(2));
    assert_eq!(memory.exact(DST, 0x10000, 0x16000), None, "not the whole chunk");
    assert_eq!(memory.exact(DST, 0x4000, 0x10000), None, "not a chunk's start");
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
/// its memory does: every window mixes written and unchanged pages.
fn scattered(before: &Memory) -> (Memory, HashSet<u64>) {
    let mut memory = before.clone();
    let mut written = HashSet::new();
    let area = &mut memory[0];
    for window in 0..area.1.len() / CHUNK {
        let at = window * CHUNK + (window % 16) * PAGE as usize;
        area.1[at..at + 8].copy_from_slice(&(window as u64 ^ 0xabcd).to_le_bytes());
        written.insert(area.0 + at as u64);
    }
    (memory, written)
}

#[tokio::test(flavor = "multi_thread")]
async fn the_unchanged_pages_of_windows_with_scattered_writes_are_read_back_side_by_side() {
    let (dir, store, first) = first_stored().await;
    let (memory, written) = scattered(&before());
    let gauge = Arc::new(std::sync::Mutex::new((0, 0, 0)));
    let parent = gauged_parent(&store, &first, gauge.clone());
    let sifted = sift_tracked(&store, dir.path(), parent, &memory, written, None).await;
    let (_, most_at_once, reads) = *gauge.lock().unwrap();
    // Each of the 64 mixed windows reads its chunk once (both sides of its written page share
    // the read), and the reads wait side by side rather than one after another.
    assert_eq!(reads, 64, "chunks read back");
    assert!(most_at_once >= 32, "at most {most_at_once} reads ran at once");
    assert_eq!(sifted.stats().chunks_new, 64, "every mixed window is a new chunk");
    stored_whole(&store, dir.path(), sifted, &memory).await;
}

#[tokio::test(flavor = "multi_thread")]
async fn a_failed_read_back_fails_the_dump_naming_it() {
    let (dir, store, first) = first_stored().await;
    let (memory, written) = scattered(&before());
    let memory_of_first = Arc::new(ParentMemory::new(&first.id, &first.memory).unwrap());
    let parent = Parent::new(memory_of_first, |_| {
        Box::new(|| Err(ParentError::ReadTask("the disk went away".into())))
    });
    let pool = BlockPool::default();
    let (mut sink, sifting) =
        store.sift(&StagingBudget::new(64 << 20), &dir.path().join("spill"), &pool, 0, Some(parent)).unwrap();
    let failed = tokio::task::spawn_blocking(move || {
        // The sink may see the store stop taking pages once the sifter failed.
        let sending = std::panic::catch_unwind(std::panic::AssertUnwindSafe(|| {
            send(&mut sink, &memory, Some(&written));
            let _ = sink.finish();
        }));
        drop(sending);
        sifting.finish().unwrap_err()
    })
    .await
    .unwrap();
    assert!(failed.to_string().contains("the disk went away"), "{failed}");
}
