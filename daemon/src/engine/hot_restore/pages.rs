//! What is left to put in place of one restored process's lazy memory, and where that memory
//! is now: the process runs while its pages arrive, and may move memory (mremap), drop it
//! (munmap, madvise) or fork meanwhile.
//!
//! Memory is known by its address in the checkpoint ("image address"); chunks are cut there.
//! Where an image range lives now is its image address plus the offset of every mremap that
//! moved it; image ranges that were unmapped are nowhere, and their pages are not filled.

use std::collections::BTreeMap;

use crate::pages::PAGE_SIZE as PAGE;
use crate::store::LazyMemory;

/// An image range that lives `delta` bytes away from its image address.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
struct Moved {
    start: u64,
    end: u64,
    delta: i64,
}

impl Moved {
    fn now(&self, image: u64) -> u64 {
        image.wrapping_add_signed(self.delta)
    }

    /// Where the range is now.
    fn span_now(&self) -> (u64, u64) {
        (self.now(self.start), self.now(self.end))
    }

    /// The image range of what is now in `[start, end)`, if any.
    fn image_of(&self, start: u64, end: u64) -> Option<(u64, u64)> {
        let (now_start, now_end) = self.span_now();
        let (a, b) = (start.max(now_start), end.min(now_end));
        (a < b).then(|| (a.wrapping_add_signed(-self.delta), b.wrapping_add_signed(-self.delta)))
    }
}

/// A part of a chunk to put in place: `len` bytes from `offset` in the chunk go to `address`.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(super) struct Piece {
    pub offset: u64,
    pub len: u64,
    pub address: u64,
}

/// One process's lazy memory still to fill.
#[derive(Debug, Clone)]
pub(super) struct Pages {
    /// Chunks with pages still to fill, by image address: the chunk's index, its length, and a
    /// bit per page still missing (a chunk is at most 16 pages).
    todo: BTreeMap<u64, (usize, u32, u16)>,
    /// Where memory is now, sorted by image address; image addresses in none are gone.
    moved: Vec<Moved>,
    /// Chunks (by index) it stopped lacking since [`Pages::take_completed`].
    completed: Vec<usize>,
}

// A chunk's pages fit the bits of `Pages::todo`.
const _: () = assert!(crate::store::CHUNK as u64 / PAGE <= 16);

impl Pages {
    /// All of the lazy memory of process `pid` (as the checkpoint numbers it), still to fill.
    pub fn new(memory: &LazyMemory, pid: u64) -> Pages {
        let todo = memory
            .task_chunks(pid)
            .map(|(i, addr, len)| (addr, (i, len, page_bits(0, len.into()))))
            .collect();
        Pages { todo, moved: vec![Moved { start: 0, end: u64::MAX, delta: 0 }], completed: Vec::new() }
    }

    /// Nothing to fill (a process that exited).
    pub fn empty() -> Pages {
        Pages { todo: BTreeMap::new(), moved: Vec::new(), completed: Vec::new() }
    }

    /// What a child forked now lacks: the same.
    pub fn forked(&self) -> Pages {
        Pages { completed: Vec::new(), ..self.clone() }
    }

    /// The chunks (indices) it lacks some of.
    pub fn chunk_indices(&self) -> impl Iterator<Item = usize> + '_ {
        self.todo.values().map(|(i, _, _)| *i)
    }

    /// The chunks it stopped lacking since the last call (filled, or dropped).
    pub fn take_completed(&mut self) -> Vec<usize> {
        std::mem::take(&mut self.completed)
    }

    pub fn is_done(&self) -> bool {
        self.todo.is_empty()
    }

    /// Bytes still to fill.
    pub fn bytes_left(&self) -> u64 {
        self.todo.values().map(|(_, _, bits)| u64::from(bits.count_ones()) * PAGE).sum()
    }

    /// The chunks with pages still to fill from image address `from` on, in address order:
    /// image address and index.
    pub fn chunks_from(&self, from: u64) -> impl Iterator<Item = (u64, usize)> + '_ {
        self.todo.range(from..).map(|(addr, (i, _, _))| (*addr, *i))
    }

    /// The chunk (its image address and index) holding the page at `address` (where the
    /// process faulted), if that page is still to fill.
    pub fn fault(&self, address: u64) -> Option<(u64, usize)> {
        let image = self.moved.iter().find_map(|m| m.image_of(address, address + 1))?.0;
        let (addr, (i, len, bits)) = self.todo.range(..=image).next_back()?;
        let offset = image - addr;
        (offset < u64::from(*len) && bits & page_bits(offset, 1) != 0).then_some((*addr, *i))
    }

    /// The parts of the chunk at image address `chunk` still to fill, where they are now.
    pub fn pieces(&self, chunk: u64) -> Vec<Piece> {
        let Some(&(_, len, bits)) = self.todo.get(&chunk) else { return Vec::new() };
        let mut out = Vec::new();
        let mut page = 0u64;
        while page * PAGE < u64::from(len) {
            if bits & (1 << page) == 0 {
                page += 1;
                continue;
            }
            let first = page;
            while page * PAGE < u64::from(len) && bits & (1 << page) != 0 {
                page += 1;
            }
            let (start, end) = (chunk + first * PAGE, chunk + (page * PAGE).min(u64::from(len)));
            for m in &self.moved {
                let (a, b) = (start.max(m.start), end.min(m.end));
                if a < b {
                    out.push(Piece { offset: a - chunk, len: b - a, address: m.now(a) });
                }
            }
        }
        out
    }

    /// `[offset, offset + len)` of the chunk at image address `chunk` is in place, or can
    /// never be; returns how many bytes of it were still to fill.
    pub fn filled(&mut self, chunk: u64, offset: u64, len: u64) -> u64 {
        let Some((i, _, bits)) = self.todo.get_mut(&chunk) else { return 0 };
        let cleared = *bits & page_bits(offset, len);
        *bits &= !cleared;
        if *bits == 0 {
            self.completed.push(*i);
            self.todo.remove(&chunk);
        }
        u64::from(cleared.count_ones()) * PAGE
    }

    /// What is now in `[start, end)` reads zeros from now on (madvise DONTNEED): nothing of
    /// the checkpoint goes there any more.
    pub fn removed(&mut self, start: u64, end: u64) {
        for (a, b) in self.images_of(start, end) {
            self.drop_image_range(a, b);
        }
    }

    /// `[start, end)` was unmapped.
    pub fn unmapped(&mut self, start: u64, end: u64) {
        for (a, b) in self.images_of(start, end) {
            self.drop_image_range(a, b);
            self.forget(a, b);
        }
    }

    /// `[from, from + len)` moved to `to`. Whatever was at the destination is gone.
    pub fn remapped(&mut self, from: u64, to: u64, len: u64) {
        let shift = to.wrapping_sub(from) as i64;
        let moving = self.images_of(from, from + len);
        let replaced: Vec<(u64, u64)> =
            self.images_of(to, to + len).into_iter().filter(|r| !moving.contains(r)).collect();
        for (a, b) in replaced {
            self.drop_image_range(a, b);
            self.forget(a, b);
        }
        for (a, b) in moving {
            let delta = self.moved.iter().find(|m| m.start <= a && a < m.end).map_or(0, |m| m.delta);
            self.forget(a, b);
            self.moved.push(Moved { start: a, end: b, delta: delta.wrapping_add(shift) });
        }
        self.moved.sort_by_key(|m| m.start);
    }

    /// The image ranges of what is now in `[start, end)`.
    fn images_of(&self, start: u64, end: u64) -> Vec<(u64, u64)> {
        self.moved.iter().filter_map(|m| m.image_of(start, end)).collect()
    }

    /// No page of image range `[a, b)` is to be filled.
    fn drop_image_range(&mut self, a: u64, b: u64) {
        let from = a.saturating_sub(crate::store::CHUNK as u64 - 1);
        let hit: Vec<u64> = self.todo.range(from..b).map(|(addr, _)| *addr).collect();
        for addr in hit {
            let len = u64::from(self.todo[&addr].1);
            let (lo, hi) = (a.max(addr), b.min(addr + len));
            if lo < hi {
                self.filled(addr, lo - addr, hi - lo);
            }
        }
    }

    /// Image range `[a, b)` is nowhere any more.
    fn forget(&mut self, a: u64, b: u64) {
        let mut kept = Vec::with_capacity(self.moved.len() + 1);
        for m in self.moved.drain(..) {
            if m.end <= a || m.start >= b {
                kept.push(m);
                continue;
            }
            if m.start < a {
                kept.push(Moved { end: a, ..m });
            }
            if m.end > b {
                kept.push(Moved { start: b, ..m });
            }
        }
        self.moved = kept;
    }
}

/// The bits of the pages in `[offset, offset + len)` of a chunk.
fn page_bits(offset: u64, len: u64) -> u16 {
    let (first, end) = (offset / PAGE, (offset + len).div_ceil(PAGE).min(16));
    (first..end).fold(0, |bits, p| bits | (1 << p))
}

#[cfg(test)]
mod tests {
    use super::*;

    const CHUNK: u64 = 0x10000;

    /// Process 7 with two chunks at 0x100000 and one of four pages at 0x200000.
    fn pages() -> Pages {
        Pages::new(&LazyMemory::for_tests(7, &[(0x100000, 2 * CHUNK as u32), (0x200000, 0x4000)]), 7)
    }

    #[test]
    fn faults_find_their_chunk_until_it_is_filled() {
        let mut p = pages();
        assert_eq!(p.bytes_left(), 2 * CHUNK + 0x4000);
        assert_eq!(p.fault(0x110123), Some((0x110000, 1)));
        assert_eq!(p.fault(0x200000 + 0x3fff), Some((0x200000, 2)));
        assert_eq!(p.fault(0x204000), None, "past the short chunk");
        assert_eq!(p.fault(0x90000), None, "no lazy memory there");
        assert_eq!(p.filled(0x110000, 0x1000, 0x2000), 0x2000);
        assert_eq!(p.fault(0x111000), None);
        assert_eq!(p.fault(0x110000), Some((0x110000, 1)));
        assert_eq!(
            p.pieces(0x110000),
            vec![
                Piece { offset: 0, len: 0x1000, address: 0x110000 },
                Piece { offset: 0x3000, len: CHUNK - 0x3000, address: 0x113000 }
            ]
        );
        assert_eq!(p.filled(0x110000, 0, CHUNK), CHUNK - 0x2000, "only what was still to fill");
        assert_eq!(p.filled(0x110000, 0, CHUNK), 0, "filled twice");
        assert_eq!(p.chunks_from(0).map(|(a, _)| a).collect::<Vec<_>>(), vec![0x100000, 0x200000]);
        p.filled(0x100000, 0, CHUNK);
        p.filled(0x200000, 0, 0x4000);
        assert!(p.is_done());
        assert_eq!(p.take_completed(), vec![1, 0, 2], "each chunk once, as it completed");
        assert!(p.take_completed().is_empty());
    }

    #[test]
    fn moved_memory_is_filled_where_it_went() {
        let mut p = pages();
        // The second half of the first chunk and the second chunk move up by 1 MiB.
        p.remapped(0x108000, 0x208000 + 0x100000, 0x18000);
        assert_eq!(p.fault(0x108000), None, "nothing is there any more");
        assert_eq!(p.fault(0x308000), Some((0x100000, 0)));
        assert_eq!(p.fault(0x310000), Some((0x110000, 1)));
        assert_eq!(
            p.pieces(0x100000),
            vec![
                Piece { offset: 0, len: 0x8000, address: 0x100000 },
                Piece { offset: 0x8000, len: 0x8000, address: 0x308000 }
            ]
        );
        // Moved again, partly: offsets add up.
        p.remapped(0x310000, 0x400000, 0x4000);
        assert_eq!(p.fault(0x400000), Some((0x110000, 1)));
        assert_eq!(p.pieces(0x110000)[0], Piece { offset: 0, len: 0x4000, address: 0x400000 });
        assert_eq!(p.pieces(0x110000)[1], Piece { offset: 0x4000, len: CHUNK - 0x4000, address: 0x314000 });
    }

    #[test]
    fn dropped_memory_is_not_filled() {
        let mut p = pages();
        p.removed(0x101000, 0x103000);
        assert_eq!(p.fault(0x101000), None, "emptied by madvise: reads zeros");
        assert_eq!(p.fault(0x103000), Some((0x100000, 0)));
        p.unmapped(0x110000, 0x200000 + 0x2000);
        assert_eq!(p.fault(0x110000), None);
        assert_eq!(p.fault(0x202000), Some((0x200000, 2)));
        assert_eq!(p.bytes_left(), CHUNK - 0x2000 + 0x2000);
        assert_eq!(p.take_completed(), vec![1], "the chunk unmapped whole");
        let child = p.forked();
        assert_eq!(child.chunk_indices().collect::<Vec<_>>(), vec![0, 2]);
        // Memory moved onto the unmapped place stays where it went; the place's old pages
        // stay dropped.
        p.remapped(0x100000, 0x110000, 0x1000);
        assert_eq!(p.fault(0x110000), Some((0x100000, 0)));
        assert_eq!(p.fault(0x100000), None);
        // A move onto memory still to fill drops what was there.
        p.remapped(0x104000, 0x200000, 0x1000);
        assert_eq!(p.fault(0x200000), Some((0x100000, 0)));
        assert_eq!(p.fault(0x201000), None, "dropped earlier");
        assert_eq!(p.fault(0x202000), Some((0x200000, 2)));
        assert!(p.pieces(0x200000).iter().all(|piece| piece.offset >= 0x2000));
    }
}
