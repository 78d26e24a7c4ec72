//! The memory a lazy restore leaves in the store: which chunk holds which task address, and
//! in which order to prefetch.

use std::ops::Range;

use super::index::{ChunkHash, ChunkLoc};

/// One chunk of lazily restored memory.
#[derive(Debug, Clone)]
pub struct LazyChunk {
    /// Where it is stored; `None` for an all-zero chunk, which is not stored.
    pub(super) stored: Option<(ChunkHash, ChunkLoc)>,
    /// Where its bytes start in the stored chunk (a reference may take part of one).
    pub(super) offset: u32,
    pub(super) len: u32,
    /// New in its checkpoint: memory written since the previous one.
    pub(super) fresh: bool,
}

/// A run of a task's lazily restored pages, cut into consecutive chunks.
#[derive(Debug, Clone)]
struct LazyRun {
    pid: u64,
    vaddr: u64,
    end: u64,
    chunks: Range<usize>,
}

/// The lazily restored memory of one checkpoint.
#[derive(Debug, Default)]
pub struct LazyMemory {
    pub(super) id: String,
    pub(super) chunks: Vec<LazyChunk>,
    /// Start address of each chunk, and the task whose memory it is.
    addrs: Vec<u64>,
    pids: Vec<u64>,
    /// Sorted by (pid, address) once `finish` ran.
    runs: Vec<LazyRun>,
}

impl LazyMemory {
    pub(super) fn new(id: &str) -> Self {
        Self { id: id.into(), ..Default::default() }
    }

    /// Adds the run of task `pid` at `vaddr` made of `chunks`, in address order.
    pub(super) fn push_run(&mut self, pid: u64, vaddr: u64, chunks: impl IntoIterator<Item = LazyChunk>) {
        let first = self.chunks.len();
        let mut addr = vaddr;
        for chunk in chunks {
            self.addrs.push(addr);
            self.pids.push(pid);
            addr += u64::from(chunk.len);
            self.chunks.push(chunk);
        }
        self.runs.push(LazyRun { pid, vaddr, end: addr, chunks: first..self.chunks.len() });
    }

    /// The memory of process `pid` in runs of `(address, length)`, cut into chunks of at most
    /// [`super::CHUNK`] (all zero), for tests of what serves it.
    #[cfg(any(test, feature = "testing"))]
    pub fn for_tests(pid: u64, runs: &[(u64, u32)]) -> LazyMemory {
        let mut memory = LazyMemory::new("test");
        for &(vaddr, len) in runs {
            let sizes = (0..len).step_by(super::CHUNK).map(|at| (len - at).min(super::CHUNK as u32));
            memory.push_run(
                pid,
                vaddr,
                sizes.map(|len| LazyChunk { stored: None, offset: 0, len, fresh: false }),
            );
        }
        memory.finish();
        memory
    }

    pub(super) fn finish(&mut self) {
        self.runs.sort_by_key(|r| (r.pid, r.vaddr));
    }

    /// Bytes restored lazily.
    pub fn bytes(&self) -> u64 {
        self.chunks.iter().map(|c| u64::from(c.len)).sum()
    }

    pub fn is_empty(&self) -> bool {
        self.chunks.is_empty()
    }

    /// How many chunks it has.
    pub fn len(&self) -> usize {
        self.chunks.len()
    }

    /// How many tasks have memory restored lazily.
    pub fn tasks(&self) -> usize {
        self.runs.iter().map(|r| r.pid).collect::<std::collections::BTreeSet<_>>().len()
    }

    /// The chunks of task `pid`, in address order: index, start address, length.
    pub fn task_chunks(&self, pid: u64) -> impl Iterator<Item = (usize, u64, u32)> + '_ {
        let at = self.runs.partition_point(|r| r.pid < pid);
        self.runs[at..]
            .iter()
            .take_while(move |r| r.pid == pid)
            .flat_map(|r| r.chunks.clone())
            .map(|i| (i, self.addrs[i], self.chunks[i].len))
    }

    /// The task whose memory chunk `i` is, its start address and length.
    pub fn chunk_at(&self, i: usize) -> (u64, u64, u32) {
        (self.pids[i], self.addrs[i], self.chunks[i].len)
    }

    /// The checkpoint this memory is of.
    pub fn id(&self) -> &str {
        &self.id
    }

    /// The chunk holding `vaddr` of task `pid`, the offset of `vaddr` in it, and where the
    /// run of lazily restored pages holding it ends.
    pub fn locate(&self, pid: u64, vaddr: u64) -> Option<(usize, u64, u64)> {
        let at = self.runs.partition_point(|r| (r.pid, r.vaddr) <= (pid, vaddr)).checked_sub(1)?;
        let run = &self.runs[at];
        if run.pid != pid || vaddr >= run.end {
            return None;
        }
        let addrs = &self.addrs[run.chunks.clone()];
        let chunk = run.chunks.start + addrs.partition_point(|a| *a <= vaddr) - 1;
        Some((chunk, vaddr - self.addrs[chunk], run.end))
    }

    /// Stored chunks in the order to prefetch them: with `fresh_first` those written since the
    /// previous checkpoint first (the job's working set, likely touched first), then the rest;
    /// each group in address order, which is the order CRIU's background transfer asks in.
    pub(super) fn prefetch_order(&self, fresh_first: bool) -> Vec<usize> {
        let stored = |i: &usize| self.chunks[*i].stored.is_some();
        if !fresh_first {
            return (0..self.chunks.len()).filter(stored).collect();
        }
        let (mut order, rest): (Vec<usize>, Vec<usize>) =
            (0..self.chunks.len()).filter(stored).partition(|i| self.chunks[*i].fresh);
        order.extend(rest);
        order
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn chunk(len: u32, fresh: bool, stored: bool) -> LazyChunk {
        let loc = ChunkLoc {
            pack: "p".into(),
            offset: 0,
            stored_len: len,
            len,
            codec: Default::default(),
            stored_checksum: None,
        };
        LazyChunk { stored: stored.then_some(([1; 32], loc)), offset: 0, len, fresh }
    }

    #[test]
    fn addresses_map_to_chunks_and_offsets() {
        let mut m = LazyMemory::new("x");
        m.push_run(9, 0x10000, [chunk(0x10000, false, true), chunk(0x4000, true, true)]);
        m.push_run(7, 0x30000, [chunk(0x8000, false, false)]);
        m.push_run(9, 0x8000, [chunk(0x8000, true, true)]);
        m.finish();
        assert_eq!(m.locate(9, 0x10000), Some((0, 0, 0x24000)));
        assert_eq!(m.locate(9, 0x21000), Some((1, 0x1000, 0x24000)));
        assert_eq!(m.locate(9, 0x9000), Some((3, 0x1000, 0x10000)));
        assert_eq!(m.locate(7, 0x37000), Some((2, 0x7000, 0x38000)));
        assert_eq!(m.locate(9, 0x24000), None, "past the run");
        assert_eq!(m.locate(7, 0x10000), None, "another task's address");
        assert_eq!(m.locate(8, 0x30000), None);
        assert_eq!(m.bytes(), 0x24000);
        let nine: Vec<_> = m.task_chunks(9).collect();
        assert_eq!(nine, vec![(3, 0x8000, 0x8000), (0, 0x10000, 0x10000), (1, 0x20000, 0x4000)]);
        assert_eq!(m.task_chunks(8).count(), 0);
        assert_eq!(m.chunk_at(2), (7, 0x30000, 0x8000));
        assert_eq!(m.prefetch_order(true), vec![1, 3, 0], "fresh first; zero chunks never fetched");
        assert_eq!(m.prefetch_order(false), vec![0, 1, 3]);
    }
}
