//! How far ahead of a fault the fault server asks for memory, per process: a window that
//! doubles while the faults walk memory upwards (each lands a little past what the window
//! before brought in, as a sequential or strided read does) and falls back to its least on a
//! fault anywhere else, as the kernel's file read-ahead does. A job reading a large region it
//! did not write since the last checkpoint (model weights, a read-mostly table), which the
//! fresh-first prefetch does not bring early, thus gets it in ever larger requests; random
//! faults ask for no more than before.

/// Chunks asked for after a fault that follows no walk (64 KiB each: about 1 MiB).
pub(super) const LEAST: usize = 15;
/// The most chunks asked for at once (32 MiB); the prefetch cache bounds what is held.
pub(super) const MOST: usize = 512;

/// One process's read-ahead.
#[derive(Debug, Clone)]
pub(super) struct ReadAhead {
    window: usize,
    /// The last fault's image address and the address of the last chunk asked for after it.
    last: Option<(u64, u64)>,
}

impl Default for ReadAhead {
    fn default() -> Self {
        ReadAhead { window: LEAST, last: None }
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
            self.window = LEAST;
            return (LEAST, chunk);
        };
        // Past what the last fault asked for, and within one more window of it.
        let slack = self.window as u64 * chunk_len;
        match chunk {
            c if c <= reach => (0, reach),
            c if c <= reach.saturating_add(slack) => {
                self.window = (self.window * 2).min(MOST);
                (self.window, reach)
            }
            _ => {
                self.window = LEAST;
                (LEAST, chunk)
            }
        }
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

    #[test]
    fn a_fault_elsewhere_falls_back_to_the_least() {
        let mut ra = ReadAhead::default();
        assert_eq!(walk(&mut ra, &[0, 16 * CHUNK, 47 * CHUNK]), [LEAST, 30, 60]);
        // Backwards, then far ahead: random.
        assert_eq!(walk(&mut ra, &[CHUNK]), [LEAST]);
        assert_eq!(walk(&mut ra, &[1 << 40]), [LEAST]);
        // The same chunk again (another page of it) is no walk either.
        assert_eq!(walk(&mut ra, &[1 << 40]), [LEAST]);
    }
}
