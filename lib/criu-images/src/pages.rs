//! A dump's memory as CRIU hands it over: runs of pages, each for one pagemap (a process's
//! private memory, or a shared segment), and the sink they go to. Shared by the page server
//! that receives them (`criu/`) and the store that keeps them (`store/`), neither of which
//! needs the other for it.

use std::io::{self, Read};

/// Page size of the dumped tasks (x86-64).
pub const PAGE_SIZE: u64 = 4096;

/// Pagemap entry flags (CRIU's `PE_*`).
pub const PE_PARENT: u32 = 1;
pub const PE_LAZY: u32 = 2;
pub const PE_PRESENT: u32 = 4;

/// One run of pages as CRIU announced it.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct PageRun {
    /// CRIU's pagemap id: `(id << 8) | type`.
    pub dst_id: u64,
    pub vaddr: u64,
    pub nr_pages: u64,
    /// `PE_*` flags.
    pub flags: u32,
}

impl PageRun {
    pub fn has_data(&self) -> bool {
        self.flags & PE_PRESENT != 0
    }

    pub fn byte_len(&self) -> u64 {
        self.nr_pages * PAGE_SIZE
    }

    /// Whether `next` goes on where this run ends: same destination and flags, the next page.
    pub fn continued_by(&self, next: &PageRun) -> bool {
        self.dst_id == next.dst_id && self.flags == next.flags && self.vaddr + self.byte_len() == next.vaddr
    }
}

/// Where received pages go.
pub trait PageSink {
    /// CRIU opened pagemap `dst_id` (`(id << 8) | type`): the dump has that memory image,
    /// even if no run of it follows.
    fn open(&mut self, dst_id: u64) -> io::Result<()>;

    /// Takes a run; when it has data, exactly `run.byte_len()` bytes must be read from `data`.
    fn run(&mut self, run: PageRun, data: &mut dyn Read) -> io::Result<()>;

    /// CRIU sent its last page and waits for its close to be answered: the tree it dumps is
    /// still stopped until then. An error fails the dump.
    fn close(&mut self) -> io::Result<()> {
        Ok(())
    }
}

/// The memory of a tree's previous checkpoint, as a dump tracking dirty pages sees it: CRIU
/// may send a run as "in parent" (no data, unchanged since then) only for a pagemap the
/// previous checkpoint has, and only for pages it holds.
pub trait InParent: Sync {
    /// Whether the previous checkpoint has pagemap `dst_id`.
    fn has(&self, dst_id: u64) -> bool;

    /// Whether the previous checkpoint holds every page of `run`.
    fn covers(&self, run: &PageRun) -> bool;
}
