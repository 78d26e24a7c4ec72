//! Unchanged pages read from the frozen tree itself, for windows that also hold written ones.
//!
//! With memory tracking, CRIU sends the pages written since the previous checkpoint and names
//! the rest "in parent". A window (one chunk's span) holding both makes a new chunk, and its
//! unchanged pages would be read back from the previous checkpoint: a store read, a check and
//! a decompression for each such window, of which a job writing a word here and there makes
//! one per write. While CRIU dumps, the tree is stopped and those pages are in its memory as
//! they were when CRIU looked: the page server's thread reads them from there instead, before
//! it answers CRIU's close (so never after the tree runs again), and passes them on ahead of
//! the runs that need them. Where a read fails (or the tree is not known), the chunker reads
//! back from the previous checkpoint as before.
//!
//! A process could end, and its pid be taken by another, while CRIU dumps; reads are not
//! checked one by one (under emulation, checking after each read cost as much as the read):
//! once the last read is done, before CRIU's close is answered, every process read from must
//! still be the one that was inspected. A process there at the end was there all along, so
//! every read before was of it; otherwise the dump is refused.
//!
//! Which pages: the part of an in-parent run that shares a window with the written run just
//! before it (its head), and the part that shares one with the written run just after it
//! (its tail), when they continue each other. Those are exactly the chunker's mixed windows
//! of a stretch; any other read-back is left to the previous checkpoint. Not those the
//! chunker references as the previous checkpoint has them (`ParentMemory::references`: a
//! window it held as one chunk), most of them: only a window written again since is read.

use std::collections::HashMap;
use std::sync::Arc;

use stasis_criu_images::pages::{PAGE_SIZE, PE_PARENT, PageRun};

use super::chunks::CHUNK;
use super::memory::window_end;
use super::parent::ParentMemory;

/// A stopped tree's memory, as the daemon reaches it.
pub trait TreeMemory: Send {
    /// `len` bytes at `addr` of the process whose memory image is `dst_id`; `None` if they
    /// cannot be read. Whether they were that process's is known only from
    /// [`TreeMemory::still_the_same`] after the last read.
    fn read(&self, dst_id: u64, addr: u64, len: usize) -> Option<Vec<u8>>;

    /// Whether every process read from so far is still the one the reads were meant for.
    fn still_the_same(&self) -> bool;
}

/// Unchanged bytes of one image read from the tree: `start` and the bytes from there.
#[derive(Debug)]
pub struct TreePiece {
    pub dst_id: u64,
    pub start: u64,
    pub bytes: Vec<u8>,
}

/// The page server's reader of unchanged pages from the tree.
pub(super) struct FromTree {
    tree: Box<dyn TreeMemory>,
    /// The previous checkpoint, whose references make some reads needless.
    parent: Arc<ParentMemory>,
    /// Per image, whether the tree's memory matched a written page CRIU sent of it: an image
    /// is read from only once it did.
    matched: HashMap<u64, bool>,
    /// Whether bytes of it were passed on since the tree was last found the same.
    unconfirmed: bool,
}

fn window_start(addr: u64) -> u64 {
    addr - addr % CHUNK as u64
}

fn is_unchanged(run: &PageRun) -> bool {
    run.flags & PE_PARENT != 0
}

fn end(run: &PageRun) -> u64 {
    run.vaddr + run.byte_len()
}

/// The ranges of unchanged run `run` that share a window with the written runs `before` and
/// `after` it (each the run next to it in CRIU's order, if any): its head and its tail.
fn mixed_ranges(before: Option<&PageRun>, run: &PageRun, after: Option<&PageRun>) -> Vec<(u64, u64)> {
    let written_next_to = |other: Option<&PageRun>, at: u64, other_at: fn(&PageRun) -> u64| {
        other.is_some_and(|o| o.dst_id == run.dst_id && o.has_data() && !is_unchanged(o) && other_at(o) == at)
    };
    let mut ranges = Vec::new();
    let (start, stop) = (run.vaddr, end(run));
    let mut covered = start;
    if start % CHUNK as u64 != 0 && written_next_to(before, start, end) {
        covered = window_end(start).min(stop);
        ranges.push((start, covered));
    }
    if stop % CHUNK as u64 != 0 && written_next_to(after, stop, |o| o.vaddr) {
        let from = window_start(stop).max(covered);
        if from < stop {
            ranges.push((from, stop));
        }
    }
    ranges
}

impl FromTree {
    pub(super) fn new(tree: Box<dyn TreeMemory>, parent: Arc<ParentMemory>) -> Self {
        FromTree { tree, parent, matched: HashMap::new(), unconfirmed: false }
    }

    /// Refuses the dump if a process read from is no longer the one the reads were meant for.
    /// After the last read, before CRIU's close is answered.
    pub(super) fn confirm(&mut self) -> std::io::Result<()> {
        if self.unconfirmed && !self.tree.still_the_same() {
            return Err(std::io::Error::other(
                "a process of the tree ended or changed while its memory was read: the dump is refused",
            ));
        }
        self.unconfirmed = false;
        Ok(())
    }

    /// Checks image `dst_id` against `page`, the bytes CRIU sent of its written page at `addr`,
    /// the first time one comes.
    pub(super) fn check(&mut self, dst_id: u64, addr: u64, page: &[u8]) {
        if self.matched.contains_key(&dst_id) || page.len() < PAGE_SIZE as usize {
            return;
        }
        let page = &page[..PAGE_SIZE as usize];
        let same = self.tree.read(dst_id, addr, page.len()).is_some_and(|read| read == page);
        if !same {
            tracing::debug!(
                dst_id,
                addr,
                "the tree's memory differs from what CRIU sent: its unchanged pages are read back"
            );
        }
        self.matched.insert(dst_id, same);
    }

    /// The unchanged pages of `run` that share a window with the written runs next to it,
    /// read from the tree where the previous checkpoint has no references for them.
    pub(super) fn pieces(
        &mut self,
        before: Option<&PageRun>,
        run: &PageRun,
        after: Option<&PageRun>,
    ) -> Vec<TreePiece> {
        if !is_unchanged(run) || self.matched.get(&run.dst_id) != Some(&true) {
            return Vec::new();
        }
        let read = |(start, stop): (u64, u64)| {
            let bytes = self.tree.read(run.dst_id, start, (stop - start) as usize)?;
            Some(TreePiece { dst_id: run.dst_id, start, bytes })
        };
        let needed = |&(start, stop): &(u64, u64)| self.parent.references(run.dst_id, start, stop).is_none();
        let ranges: Vec<(u64, u64)> = mixed_ranges(before, run, after).into_iter().filter(needed).collect();
        let pieces: Vec<TreePiece> = ranges.into_iter().filter_map(read).collect();
        self.unconfirmed |= !pieces.is_empty();
        pieces
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use stasis_criu_images::pages::PE_PRESENT;

    const PAGE: u64 = PAGE_SIZE;

    fn written(vaddr: u64, nr_pages: u64) -> PageRun {
        PageRun { dst_id: 257, vaddr, nr_pages, flags: PE_PRESENT }
    }

    fn unchanged(vaddr: u64, nr_pages: u64) -> PageRun {
        PageRun { dst_id: 257, vaddr, nr_pages, flags: PE_PARENT }
    }

    #[test]
    fn a_word_written_in_unchanged_memory_makes_a_head_and_a_tail() {
        let w = CHUNK as u64;
        // Unchanged, one written page at 0x10000 + 7 pages, unchanged again.
        let before = unchanged(0, 16 + 7);
        let page = written(w + 7 * PAGE, 1);
        let after = unchanged(w + 8 * PAGE, 100);
        assert_eq!(mixed_ranges(None, &before, Some(&page)), [(w, w + 7 * PAGE)], "the tail");
        assert_eq!(mixed_ranges(Some(&page), &after, None), [(w + 8 * PAGE, 2 * w)], "the head");
    }

    #[test]
    fn a_short_run_between_written_pages_is_read_once_and_aligned_edges_not_at_all() {
        let w = CHUNK as u64;
        let run = unchanged(3 * PAGE, 2);
        let (a, b) = (written(0, 3), written(5 * PAGE, 1));
        assert_eq!(mixed_ranges(Some(&a), &run, Some(&b)), [(3 * PAGE, 5 * PAGE)]);
        // Starting and ending on window boundaries: nothing shares a window.
        let run = unchanged(w, 16);
        assert!(mixed_ranges(Some(&written(0, 16)), &run, Some(&written(2 * w, 1))).is_empty());
        // Neighbours that do not touch it, or of another image, or unchanged too.
        let run = unchanged(PAGE, 2);
        assert!(mixed_ranges(Some(&written(PAGE * 100, 1)), &run, None).is_empty());
        let other = PageRun { dst_id: 513, ..written(0, 1) };
        assert!(mixed_ranges(Some(&other), &run, None).is_empty());
        assert!(mixed_ranges(Some(&unchanged(0, 1)), &run, None).is_empty());
    }

    struct Memory(Vec<u8>, bool);

    /// A previous checkpoint without memory: it has no references, every mixed range is read.
    fn no_parent() -> Arc<ParentMemory> {
        Arc::new(ParentMemory::new("previous", &[]).unwrap())
    }

    impl TreeMemory for Memory {
        fn read(&self, _: u64, addr: u64, len: usize) -> Option<Vec<u8>> {
            self.0.get(addr as usize..addr as usize + len).map(<[u8]>::to_vec)
        }

        fn still_the_same(&self) -> bool {
            self.1
        }
    }

    #[test]
    fn an_image_is_read_only_after_its_memory_matched_a_written_page() {
        let memory: Vec<u8> = (0..4 * PAGE).map(|i| (i / PAGE) as u8 + 1).collect();
        let mut tree = FromTree::new(Box::new(Memory(memory.clone(), true)), no_parent());
        let (page, run) = (written(PAGE, 1), unchanged(2 * PAGE, 2));
        assert!(tree.pieces(Some(&page), &run, None).is_empty(), "not checked yet");
        tree.check(257, PAGE, &[9; PAGE as usize]);
        assert!(tree.pieces(Some(&page), &run, None).is_empty(), "another process's memory");

        let mut tree = FromTree::new(Box::new(Memory(memory.clone(), true)), no_parent());
        tree.check(257, PAGE, &memory[PAGE as usize..2 * PAGE as usize]);
        let pieces = tree.pieces(Some(&page), &run, None);
        assert_eq!(pieces.len(), 1);
        assert_eq!((pieces[0].dst_id, pieces[0].start), (257, 2 * PAGE));
        assert_eq!(pieces[0].bytes, memory[2 * PAGE as usize..]);
        assert!(tree.confirm().is_ok());
    }

    #[test]
    fn reads_of_a_process_that_changed_meanwhile_refuse_the_dump_and_no_reads_nothing() {
        let memory: Vec<u8> = (0..4 * PAGE).map(|i| (i / PAGE) as u8 + 1).collect();
        let mut tree = FromTree::new(Box::new(Memory(memory.clone(), false)), no_parent());
        assert!(tree.confirm().is_ok(), "nothing was read");
        tree.check(257, PAGE, &memory[PAGE as usize..2 * PAGE as usize]);
        assert_eq!(tree.pieces(Some(&written(PAGE, 1)), &unchanged(2 * PAGE, 2), None).len(), 1);
        let refused = tree.confirm().unwrap_err();
        assert!(refused.to_string().contains("ended or changed"), "{refused}");
    }
}
