//! Putting chunks in place: copying what a process still lacks of a chunk into it, coping
//! with what the process did meanwhile, and choosing what to put in place next when no fault
//! waits. Each chunk leaves the cache once no process lacks any of it.
//!
//! A chunk of zeros is copied like any other: its pages were in the process's memory when it
//! was checkpointed, and a restore gives them back as the process had them (as plain CRIU
//! does), not as the shared zero page, which would leave the tree holding less memory than it
//! held and allocate it on the process's first writes instead. Only memory the checkpoint
//! has nothing for gets the zero page.

use super::pages::{Pages, Piece};
use super::server::{FaultServer, FaultServerError};
use crate::linux::uffd::FillError;
use crate::pages::PAGE_SIZE as PAGE;
use crate::store::{Ask, CHUNK, ChunkData};
use tracing::debug;

/// The bytes of a zero chunk, or of any part of one.
static ZEROS: [u8; CHUNK] = [0; CHUNK];

/// Bytes put in place in the background between two looks for faults...
const BACKGROUND_BUDGET: u64 = 512 << 10;
/// ...and between two looks for the chunks that faults wait for.
const WAITING_BUDGET: u64 = 128 << 10;

/// How putting one piece in place went.
enum Placed {
    All,
    /// The process's mappings are changing: its events must be read first. The first bytes
    /// are in place.
    Interrupted(u64),
    /// The page at this offset is in no mapping registered with the userfaultfd.
    NoMapping(u64),
    /// The process exited.
    Gone,
}

impl FaultServer {
    /// Puts in place what task `t` still lacks of the chunk at image address `addr`. Returns
    /// `false` when it has to wait for a mapping change to finish first (the rest stays to
    /// fill).
    pub(super) fn put_chunk(
        &mut self,
        t: usize,
        addr: u64,
        data: &ChunkData,
    ) -> Result<bool, FaultServerError> {
        let mut registered = None;
        'again: loop {
            for piece in self.tasks[t].pages.pieces(addr) {
                match self.place(t, piece, Some(data))? {
                    Placed::All => self.filled(t, addr, piece.offset, piece.len),
                    Placed::Interrupted(done) => {
                        self.filled(t, addr, piece.offset, done);
                        if self.read_events(t)? == 0 {
                            // Its event comes once the change is done.
                            self.changing = true;
                            return Ok(false);
                        }
                        continue 'again;
                    }
                    Placed::NoMapping(done) => {
                        self.filled(t, addr, piece.offset, done);
                        let address = piece.address + done;
                        if self.read_events(t)? > 0 {
                            // An unmap or a move, just read: the pieces are elsewhere now.
                            continue 'again;
                        }
                        self.unregistered(t, addr, piece.offset + done, address, &mut registered)?;
                        continue 'again;
                    }
                    Placed::Gone => {
                        self.gone(t);
                        return Ok(true);
                    }
                }
            }
            break;
        }
        self.settle(t);
        Ok(true)
    }

    /// A page of the chunk at `addr` (at `offset` in it) lies at `address`, where no
    /// registered mapping is. Either nothing is mapped there any more (nothing can read it:
    /// it is dropped), or CRIU left its mapping unregistered (which would read zeros):
    /// registering it settles which, and fixes the second. Twice for one page is an error.
    fn unregistered(
        &mut self,
        t: usize,
        addr: u64,
        offset: u64,
        address: u64,
        registered: &mut Option<u64>,
    ) -> Result<(), FaultServerError> {
        let task = &self.tasks[t];
        if *registered == Some(address) {
            return Err(FaultServerError::Unregistered { pid: task.pid, address });
        }
        match task.uffd.register(address, PAGE) {
            Ok(()) => {
                debug!(pid = task.pid, address, "registered a page CRIU had left unregistered");
                *registered = Some(address);
            }
            Err(_) => {
                self.tasks[t].pages.filled(addr, offset, PAGE);
            }
        }
        Ok(())
    }

    /// Maps a zero page at `page` of task `t` (memory the checkpoint has nothing for there);
    /// `false` when it has to wait for a mapping change to finish first.
    pub(super) fn put_zero_page(&mut self, t: usize, page: u64) -> Result<bool, FaultServerError> {
        let piece = Piece { offset: 0, len: PAGE, address: page };
        match self.place(t, piece, None)? {
            Placed::Interrupted(_) => {
                self.read_events(t)?;
                self.changing = true;
                Ok(false)
            }
            Placed::Gone => {
                self.gone(t);
                Ok(true)
            }
            // Nothing is mapped there any more: the thread faults again, elsewhere or not.
            Placed::All | Placed::NoMapping(_) => Ok(true),
        }
    }

    /// Takes note of the chunks the decoding threads put in place (see direct.rs): each in the
    /// task they put it in, the first of its pid (a child forked since has its own copy of
    /// what was missing then, and gets it from the server).
    pub(super) fn placed_directly(&mut self) {
        for i in self.chunks.take_placed() {
            let (pid, addr, len) = self.chunks.memory().chunk_at(i);
            if let Some(t) = self.tasks.iter().position(|t| t.pid as u64 == pid) {
                self.filled(t, addr, 0, len.into());
                self.settle(t);
            }
        }
    }

    /// `[offset, offset + len)` of the chunk at `addr` is in place in task `t`: counted as
    /// placed as far as it was still to fill (a page found there already, or placed twice, is
    /// counted once).
    fn filled(&mut self, t: usize, addr: u64, offset: u64, len: u64) {
        let placed = self.tasks[t].pages.filled(addr, offset, len);
        self.stats.bytes_placed += placed;
        self.control.placed.fetch_add(placed, std::sync::atomic::Ordering::Relaxed);
    }

    /// Task `t` exited: nothing of it is needed any more.
    fn gone(&mut self, t: usize) {
        debug!(pid = self.tasks[t].pid, "a restored process exited before its memory was in");
        let task = &mut self.tasks[t];
        task.gone = true;
        let left = std::mem::replace(&mut task.pages, Pages::empty());
        for i in left.chunk_indices() {
            self.needed_less(i);
        }
        self.settle(t);
    }

    /// Counts the chunks task `t` no longer lacks any of; releases those nobody lacks.
    pub(super) fn settle(&mut self, t: usize) {
        for i in self.tasks[t].pages.take_completed() {
            self.needed_less(i);
        }
    }

    fn needed_less(&mut self, i: usize) {
        self.needs[i] = self.needs[i].saturating_sub(1);
        if self.needs[i] == 0 {
            self.chunks.release(i);
        }
    }

    /// Copies one piece of a chunk's `data` into task `t`, or maps the zero page there when
    /// there is no chunk. A span that crosses mappings is cut in halves until each piece lies
    /// in one.
    fn place(&self, t: usize, piece: Piece, data: Option<&ChunkData>) -> Result<Placed, FaultServerError> {
        let task = &self.tasks[t];
        let (mut at, mut span) = (0u64, piece.len);
        while at < piece.len {
            let len = span.min(piece.len - at);
            let dst = piece.address + at;
            let from = (piece.offset + at) as usize;
            let result = match data {
                None => task.uffd.zero(dst, len),
                Some(ChunkData::Zero) => task.uffd.copy(dst, &ZEROS[from..from + len as usize]),
                Some(ChunkData::Bytes(bytes)) => task.uffd.copy(dst, &bytes[from..from + len as usize]),
            };
            let FillError { errno, done } = match result {
                Ok(()) => {
                    at += len;
                    span = piece.len;
                    continue;
                }
                Err(e) if e.exists() => {
                    // That page is there already; go on after it.
                    at += e.done + PAGE;
                    continue;
                }
                Err(e) if e.again() => return Ok(Placed::Interrupted(at + e.done)),
                Err(e) if e.gone() => return Ok(Placed::Gone),
                Err(e) if e.no_mapping() && len - e.done > PAGE => {
                    at += e.done;
                    span = ((len - e.done) / 2).next_multiple_of(PAGE);
                    continue;
                }
                Err(e) if e.no_mapping() => return Ok(Placed::NoMapping(at + e.done)),
                Err(e) => e,
            };
            return Err(FaultServerError::Fill { pid: task.pid, address: dst + done, errno });
        }
        Ok(Placed::All)
    }

    /// Puts chunks that are here in place: those asked for after a fault first, then the
    /// others as they arrived (the prefetcher's order), then what is left in address order;
    /// whether it stopped for its budget (more is ready). It runs while faults that follow no
    /// pattern wait for their chunks too (a little at a time): the cache drains, so the
    /// prefetcher, which fetches only so far ahead of what is in place, goes on. A new fault
    /// ends it at once.
    pub(super) fn background(&mut self) -> Result<bool, FaultServerError> {
        let mut budget = if self.faults.is_empty() { BACKGROUND_BUDGET } else { WAITING_BUDGET };
        let waiting = self.faults.len();
        while budget > 0 {
            let Some((t, addr, data)) = self.next_ready()? else { return Ok(false) };
            let before = self.stats.bytes_placed;
            if !self.put_chunk(t, addr, &data)? {
                return Ok(false);
            }
            budget = budget.saturating_sub((self.stats.bytes_placed - before).max(PAGE));
            // A fault that came meanwhile is answered first (a job walking its memory faults
            // on the chunk after the one it waited for, often here already).
            self.read_all_events()?;
            if self.faults.len() > waiting {
                break;
            }
        }
        Ok(true)
    }

    /// The next chunk to put in place that is here: task, image address, bytes.
    fn next_ready(&mut self) -> Result<Option<(usize, u64, ChunkData)>, FaultServerError> {
        for t in 0..self.tasks.len() {
            while let Some(&(addr, index)) = self.tasks[t].ahead.front() {
                if self.tasks[t].pages.pieces(addr).is_empty() {
                    self.tasks[t].ahead.pop_front();
                    continue;
                }
                match self.chunks.peek(index) {
                    Some(data) => {
                        self.tasks[t].ahead.pop_front();
                        return Ok(Some((t, addr, data)));
                    }
                    None => break,
                }
            }
        }
        loop {
            if self.arrived.is_empty() {
                self.arrived = self.chunks.take_arrived().into();
            }
            let Some(index) = self.arrived.pop_front() else { break };
            let (pid, addr, _) = self.chunks.memory().chunk_at(index);
            let needing =
                self.tasks.iter().position(|t| t.pid as u64 == pid && !t.pages.pieces(addr).is_empty());
            if let (Some(t), Some(data)) = (needing, self.chunks.peek(index)) {
                return Ok(Some((t, addr, data)));
            }
        }
        self.left_over()
    }

    /// The first chunk still to fill, in task and address order, if it is here; zero chunks
    /// always are. One the prefetcher no longer brings (released while another process of the
    /// same pid still lacked it, a forked child) is asked for.
    fn left_over(&mut self) -> Result<Option<(usize, u64, ChunkData)>, FaultServerError> {
        while self.cursor.0 < self.tasks.len() {
            let (t, from) = self.cursor;
            let Some((addr, index)) = self.tasks[t].pages.chunks_from(from).next() else {
                self.cursor = (t + 1, 0);
                continue;
            };
            self.cursor.1 = addr;
            let got = self.chunks.get(index, Ask::IfDropped).map_err(FaultServerError::Fetch)?;
            return Ok(got.map(|data| (t, addr, data)));
        }
        // A child forked after the cursor passed: start over.
        if self.tasks.iter().any(|t| !t.gone && !t.pages.is_done()) {
            self.cursor = (0, 0);
        }
        Ok(None)
    }
}
