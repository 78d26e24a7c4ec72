//! How far ahead of a fault the fault server asks for memory, per process: a window that
//! doubles while the faults walk memory upwards (each lands a little past what the window
//! before brought in, as a sequential or strided read does) and falls back to its least on a
//! fault anywhere else, as the kernel's file read-ahead does. A job reading a large region it
//! did not write since the last checkpoint (model weights, a read-mostly table), which the
//! fresh-first prefetch does not bring early, thus gets it in ever larger requests; random
//! faults ask for no more than before.
//!
//! A job reading blocks spaced evenly apart (every tenth MiB of a table, one layer's slice of
//! each tensor) faults far from the last fault each time, which is no walk. When two such
//! jumps in a row cover the same distance, the read is strided: each jump then also asks for
//! the blocks [`STRIDES_AHEAD`] strides on, so that the job finds them in place. A jump by a
//! few strides at once (the job read the blocks asked for without faulting) keeps the stride.

/// Chunks asked for after a fault that follows no walk (64 KiB each: about 1 MiB).
pub(super) const LEAST: usize = 15;
/// The most chunks asked for at once (32 MiB); the prefetch cache bounds what is held.
pub(super) const MOST: usize = 512;
/// Blocks asked for ahead of a strided read, each of [`LEAST`] + 1 chunks from where the next
/// fault is due (and some around it).
pub(super) const STRIDES_AHEAD: u64 = 8;

/// Chunks a strided block is asked for before and after where it is due: the mean stride
/// puts it within a chunk or so.
const SPREAD: u64 = 2;

/// One process's read-ahead.
#[derive(Debug, Clone)]
pub(super) struct ReadAhead {
    window: usize,
    /// The last fault's image address and the address of the last chunk asked for after it.
    last: Option<(u64, u64)>,
    /// The last fault that followed no walk (a jump), and the distance it jumped.
    jump: Option<(u64, u64)>,
    /// The read's stride, once two jumps in a row agree.
    stride: Option<Stride>,
}

/// Blocks spaced evenly: the jump the stride was first seen from, the block the faults are
/// in now (counted from there), and the mean stride (the faults land a chunk early or late: a
/// block's start need not be a chunk's).
#[derive(Debug, Clone, Copy)]
struct Stride {
    from: u64,
    strides: u64,
    mean: u64,
}

impl Stride {
    /// Block `n` as asked for: where it is due, [`LEAST`] + 1 chunks, and [`SPREAD`] chunks
    /// more on each side.
    fn block(&self, n: u64, chunk_len: u64) -> Option<std::ops::Range<u64>> {
        let due = self.from.checked_add(n.checked_mul(self.mean)?)?;
        let len = (LEAST as u64 + 1 + SPREAD) * chunk_len;
        Some(due.saturating_sub(SPREAD * chunk_len)..due.checked_add(len)?)
    }

    /// The stride after a jump to `chunk`, if the jump continued it: `chunk` lies in one of
    /// the next [`STRIDES_AHEAD`] + 1 blocks (more than one on: the job read the blocks
    /// between without faulting; anywhere in it: its first chunks were in place already). A
    /// fault where a block is due refines the mean.
    fn went_on(self, chunk: u64, chunk_len: u64) -> Option<Stride> {
        let spread = SPREAD * chunk_len;
        let n = chunk.checked_add(spread)?.checked_sub(self.from)? / self.mean.max(1);
        let ahead = n.checked_sub(self.strides)?;
        if !(1..=STRIDES_AHEAD + 1).contains(&ahead) || !self.block(n, chunk_len)?.contains(&chunk) {
            return None;
        }
        let due = self.from + n * self.mean;
        let mean = if chunk.abs_diff(due) <= spread { (chunk - self.from) / n } else { self.mean };
        Some(Stride { strides: n, mean, ..self })
    }
}

impl Default for ReadAhead {
    fn default() -> Self {
        ReadAhead { window: LEAST, last: None, jump: None, stride: None }
    }
}

impl ReadAhead {
    /// How many chunks to ask for after a fault in the chunk at image address `chunk` (the
    /// window, doubled if this fault continues a walk), and up to which address they were
    /// asked for already (by the fault before, on a walk; else none past `chunk`).
    ///
    /// A fault past the last one but within what was asked for already is the job waiting for
    /// read-ahead still on its way: nothing more is asked for and the window stays as it is
    /// (as the kernel grows its read-ahead only once a read goes past the window). Doubling
    /// there would have a job reading a few blocks spread over its memory (each block faulting
    /// a few times while it arrives) ask for tens of MiB between them that it never reads.
    pub(super) fn window_for(&mut self, chunk: u64, chunk_len: u64) -> (usize, u64) {
        let Some((_, reach)) = self.last.filter(|&(fault, _)| chunk > fault) else {
            return self.jumped(chunk, chunk_len);
        };
        if let Some(block) = self.current_block(chunk_len).filter(|b| b.contains(&chunk)) {
            return (0, reach.max(block.end - chunk_len));
        }
        // Past what the last fault asked for, and within one more window of it.
        let slack = self.window as u64 * chunk_len;
        match chunk {
            c if c <= reach => (0, reach),
            c if c <= reach.saturating_add(slack) => {
                self.window = (self.window * 2).min(MOST);
                (self.window, reach)
            }
            _ => self.jumped(chunk, chunk_len),
        }
    }

    /// A fault at `chunk` that follows no walk: the window falls back to its least, and the
    /// jump tells whether the read is strided. Two distances agree within two chunks per
    /// stride; once a stride is known, a fault anywhere in one of the next blocks continues it,
    /// and asks for no more than the rest of that block (asked for already, by the jumps
    /// before).
    fn jumped(&mut self, chunk: u64, chunk_len: u64) -> (usize, u64) {
        self.window = LEAST;
        let continues = self.stride.is_some();
        let distance = self.jump.and_then(|(at, _)| chunk.checked_sub(at)).filter(|&d| d > 0);
        self.stride = match (distance, self.stride, self.jump) {
            (_, Some(s), _) => s.went_on(chunk, chunk_len),
            (Some(d), None, Some((at, before))) if before > 0 && d.abs_diff(before) <= 2 * chunk_len => {
                let from = at - before;
                Some(Stride { from, strides: 2, mean: (chunk - from) / 2 })
            }
            _ => None,
        };
        self.jump = Some((chunk, distance.unwrap_or(0)));
        match self.current_block(chunk_len).filter(|_| continues) {
            Some(block) => {
                let rest = (block.end.saturating_sub(chunk) / chunk_len).saturating_sub(1);
                (rest.min(LEAST as u64) as usize, chunk)
            }
            None => (LEAST, chunk),
        }
    }

    /// The block of a strided read the faults are in (image addresses), as asked for.
    fn current_block(&self, chunk_len: u64) -> Option<std::ops::Range<u64>> {
        self.stride.and_then(|s| s.block(s.strides, chunk_len))
    }

    /// The next [`STRIDES_AHEAD`] blocks of a strided read that the fault at `chunk` continued
    /// (none unless that fault was a jump by the stride): where each is due, widened by
    /// [`SPREAD`] chunks on each side, as a range of image addresses.
    pub(super) fn strides_ahead(&self, chunk: u64, chunk_len: u64) -> Vec<std::ops::Range<u64>> {
        let (Some(stride), Some((at, _))) = (self.stride, self.jump) else { return Vec::new() };
        if at != chunk {
            return Vec::new();
        }
        (1..=STRIDES_AHEAD).filter_map(|k| stride.block(stride.strides + k, chunk_len)).collect()
    }

    /// Whether the faults follow a pattern: a walk (the window grew) or a stride.
    pub(super) fn following(&self) -> bool {
        self.window > LEAST || self.stride.is_some()
    }

    /// Records the fault at `chunk` and the last chunk asked for after it (`reach`: the last
    /// one asked for now, else what [`ReadAhead::window_for`] said was asked for already).
    pub(super) fn asked(&mut self, chunk: u64, reach: u64) {
        self.last = Some((chunk, reach.max(chunk)));
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    const CHUNK: u64 = 64 << 10;

    /// Faults at each of `chunks` (image addresses), each asking for its window of
    /// consecutive chunks; the windows.
    fn walk(ra: &mut ReadAhead, chunks: &[u64]) -> Vec<usize> {
        chunks
            .iter()
            .map(|&at| {
                let (window, through) = ra.window_for(at, CHUNK);
                ra.asked(at, (at + window as u64 * CHUNK).max(through));
                window
            })
            .collect()
    }

    #[test]
    fn a_sequential_read_doubles_the_window_up_to_the_most() {
        let mut ra = ReadAhead::default();
        // Each fault lands just past what the one before asked for.
        let mut at = 0;
        let mut windows = Vec::new();
        for _ in 0..10 {
            let window = walk(&mut ra, &[at])[0];
            windows.push(window);
            at += (window as u64 + 1) * CHUNK;
        }
        assert_eq!(windows[..7], [LEAST, 30, 60, 120, 240, 480, MOST]);
        assert!(windows[7..].iter().all(|&w| w == MOST));
    }

    #[test]
    fn a_strided_read_within_a_window_of_the_last_counts_as_a_walk() {
        let mut ra = ReadAhead::default();
        // Every 1.5 MiB: past the 1 MiB the first fault brings, within one more window; the
        // third lands in what the second asked for (0: on its way), the fourth past it.
        let faults: Vec<u64> = (0..4).map(|i| i * 24 * CHUNK).collect();
        assert_eq!(walk(&mut ra, &faults), [LEAST, 30, 0, 60]);
    }

    #[test]
    fn faults_in_what_was_asked_for_neither_grow_the_window_nor_ask_more() {
        let mut ra = ReadAhead::default();
        // A 1 MiB block read page by page while its chunks arrive: every fault after the first
        // lands in what the first asked for.
        let block: Vec<u64> = (0..16).map(|i| i * CHUNK).collect();
        assert_eq!(walk(&mut ra, &block), [[LEAST].as_slice(), &[0; 15]].concat());
        // The next block, 10 MiB on: far past, so no walk.
        assert_eq!(walk(&mut ra, &[160 * CHUNK]), [LEAST]);
        // Reading on past the block: a walk from what the block's fault asked for.
        assert_eq!(walk(&mut ra, &[176 * CHUNK]), [30]);
    }

    #[test]
    fn a_walk_skips_what_the_fault_before_asked_for() {
        let mut ra = ReadAhead::default();
        assert_eq!(ra.window_for(0, CHUNK), (LEAST, 0), "nothing asked for before");
        ra.asked(0, 15 * CHUNK);
        assert_eq!(ra.window_for(16 * CHUNK, CHUNK), (30, 15 * CHUNK));
        assert_eq!(ra.window_for(1 << 40, CHUNK), (LEAST, 1 << 40), "elsewhere: all of it anew");
    }

    /// The first chunk of each block the next fault after `at` asks for strides ahead.
    fn due(ra: &ReadAhead, at: u64) -> Vec<u64> {
        ra.strides_ahead(at, CHUNK).iter().map(|r| r.start).collect()
    }

    #[test]
    fn blocks_spaced_evenly_are_asked_for_strides_ahead() {
        let mut ra = ReadAhead::default();
        // 1 MiB blocks every 10 MiB, each read page by page.
        let block = |b: u64| -> Vec<u64> { (0..16).map(|i| (b * 160 + i) * CHUNK).collect() };
        walk(&mut ra, &block(0));
        assert!(due(&ra, 0).is_empty(), "one block says nothing");
        walk(&mut ra, &block(1));
        assert!(due(&ra, 160 * CHUNK).is_empty(), "one distance says nothing yet");
        walk(&mut ra, &block(2)[..1]);
        let ahead = ra.strides_ahead(320 * CHUNK, CHUNK);
        assert_eq!(ahead.len() as u64, STRIDES_AHEAD);
        for (k, range) in (1..).zip(&ahead) {
            let start = (2 + k) * 160 * CHUNK;
            assert!(range.start <= start && start + 16 * CHUNK <= range.end, "block {k}: {range:?}");
        }
        walk(&mut ra, &block(2)[1..]);
        assert!(due(&ra, 321 * CHUNK).is_empty(), "only a jump asks for strides");
        // The job read the blocks asked for without faulting, and faults next at block 11, a
        // chunk late (its first chunk was in place).
        walk(&mut ra, &[(11 * 160 + 1) * CHUNK]);
        let next = ra.strides_ahead((11 * 160 + 1) * CHUNK, CHUNK);
        assert!(next[0].contains(&(12 * 160 * CHUNK)), "the stride holds: {:?}", next[0]);
        // Elsewhere: no longer strided.
        let far = (11 * 160 + 7) * CHUNK + (1 << 30);
        walk(&mut ra, &[far]);
        assert!(due(&ra, far).is_empty());
    }

    #[test]
    fn the_tail_of_a_strided_block_is_no_walk() {
        let mut ra = ReadAhead::default();
        // 1 MiB blocks every 10 MiB that straddle 17 chunks (not aligned to one): the first
        // fault of a block asks for 15 more, the 17th chunk faults past them.
        let mut windows = Vec::new();
        for b in 0..6u64 {
            let start = (b * 160 + 3) * CHUNK;
            windows.push(walk(&mut ra, &[start])[0]);
            due(&ra, start);
            windows.push(walk(&mut ra, &[start + 16 * CHUNK])[0]);
        }
        // Before the stride is known the tail is a walk (30 chunks: 2 MiB the job skips);
        // once it is, the blocks asked for strides ahead hold the tail.
        assert_eq!(windows[..4], [LEAST, 30, LEAST, 30]);
        assert_eq!(windows[4..], [LEAST, 0, LEAST, 0, LEAST, 0, LEAST, 0]);
    }

    #[test]
    fn a_fault_into_a_block_keeps_the_stride_where_the_blocks_are() {
        let mut ra = ReadAhead::default();
        let start = |b: u64| (b * 160 + 3) * CHUNK;
        for b in 0..3 {
            walk(&mut ra, &[start(b)]);
        }
        // Blocks 3 and 5 had their first chunks in place: the faults land 8 and 11 chunks in.
        for (b, into) in [(3, 8), (5, 11)] {
            let at = start(b) + into * CHUNK;
            // Only the rest of the block (16 chunks and 2 more) is asked for with the fault.
            assert_eq!(walk(&mut ra, &[at])[0] as u64, 18 - into - 1, "block {b}");
            let ahead = ra.strides_ahead(at, CHUNK);
            assert!(ra.following());
            assert_eq!(ahead.len() as u64, STRIDES_AHEAD, "block {b}: the stride holds");
            for (k, range) in (1..).zip(&ahead) {
                let due = start(b + k);
                assert!(range.start <= due && due + 17 * CHUNK <= range.end, "block {}: {range:?}", b + k);
            }
        }
    }

    #[test]
    fn distances_a_chunk_apart_agree() {
        let mut ra = ReadAhead::default();
        // Block starts 160 and 161 chunks apart, as faults landing a chunk late make them.
        for at in [0, 160, 321, 481, 642] {
            walk(&mut ra, &[at * CHUNK]);
        }
        assert_eq!(due(&ra, 642 * CHUNK).len() as u64, STRIDES_AHEAD);
    }

    #[test]
    fn random_faults_are_not_strided() {
        let mut ra = ReadAhead::default();
        let mut seed = 0x9e37_79b9_7f4a_7c15u64;
        for _ in 0..1000 {
            seed ^= seed << 13;
            seed ^= seed >> 7;
            seed ^= seed << 17;
            let at = seed % (1 << 15) * CHUNK;
            walk(&mut ra, &[at]);
            assert!(due(&ra, at).is_empty(), "a stride found in random faults at {at:#x}");
        }
    }

    #[test]
    fn a_fault_elsewhere_falls_back_to_the_least() {
        let mut ra = ReadAhead::default();
        assert_eq!(walk(&mut ra, &[0, 16 * CHUNK, 47 * CHUNK]), [LEAST, 30, 60]);
        assert!(ra.following(), "a walk");
        // Backwards, then far ahead: random.
        assert_eq!(walk(&mut ra, &[CHUNK]), [LEAST]);
        assert!(!ra.following(), "no walk, no stride");
        assert_eq!(walk(&mut ra, &[1 << 40]), [LEAST]);
        // The same chunk again (another page of it) is no walk either.
        assert_eq!(walk(&mut ra, &[1 << 40]), [LEAST]);
    }
}
