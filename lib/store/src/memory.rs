//! A dump's memory images from the pages CRIU sent: runs joined into stretches, stretches cut
//! into chunks at aligned windows.
//!
//! CRIU cuts its transfers where its page-pipe buffers fill up, and those places move as soon
//! as an earlier mapping gains or loses a page. Joined, a stored run is a stretch of present
//! pages of the task's memory, and each chunk the part of an aligned window that stretch
//! covers: the same memory gives the same chunks wherever CRIU cut it, and whether it was
//! staged whole, sifted as it arrived, or streamed in blocks. A dump that tracks dirty pages
//! cuts a window that mixes unchanged and written pages by kind where the previous checkpoint
//! held it as one chunk: the unchanged pages reference their part of that chunk, the written
//! ones are a chunk of their own (`ParentMemory::references`).

use std::borrow::Cow;
use std::collections::{HashMap, VecDeque};

use stasis_proto::stasis::store::v1::{ChunkRef, MemoryImage, PageRun as StoredRun};

use super::chunks::{CHUNK, ChunkStats, ChunkWriter, UploaderGone, WindowCutter};
use super::parent::{Parent, ParentError, References};
use super::read_back::{Hole, ReadBack};
use super::staging::Staged;
use super::stream::{Received, StreamSource, Unfinished};
use stasis_criu_images::pages::{PAGE_SIZE, PE_PARENT, PageRun};

/// Where the windows of a memory image go, each coming back as its chunk's reference: the
/// store's chunk writer (a streamed dump), or a sifter staging what the store lacks.
pub(super) trait WindowSink {
    type Error;

    /// References to `windows` (each at most one chunk), in order.
    fn take(&mut self, windows: &[&[u8]]) -> Result<Vec<ChunkRef>, Self::Error>;

    /// The counts of the chunks referenced.
    fn stats(&mut self) -> &mut ChunkStats;
}

impl WindowSink for ChunkWriter<'_> {
    type Error = UploaderGone;

    fn take(&mut self, windows: &[&[u8]]) -> Result<Vec<ChunkRef>, UploaderGone> {
        self.write(windows)
    }

    fn stats(&mut self) -> &mut ChunkStats {
        &mut self.stats
    }
}

/// Why memory images could not be made: their windows' sink failed, or pages unchanged since
/// the previous checkpoint could not be had from it.
#[derive(Debug)]
pub(super) enum ChunkingError<E> {
    Sink(E),
    Parent(ParentError),
}

impl<E> From<ParentError> for ChunkingError<E> {
    fn from(e: ParentError) -> Self {
        ChunkingError::Parent(e)
    }
}

/// Builds the memory images of one dump from runs in CRIU's order (per destination; the
/// destinations may interleave), runs in parent taken from the previous checkpoint.
#[derive(Default)]
pub(super) struct MemoryChunker {
    /// Destinations in the order their first run came.
    order: Vec<u64>,
    images: HashMap<u64, Building>,
    back: ReadBack,
}

pub(super) struct Building {
    image: MemoryImage,
    /// The stretch the next run may continue: the pages so far, and its last partial window.
    open: Option<(PageRun, WindowCutter)>,
    /// Where unchanged pages that end the open stretch, not chunked yet, end; they start where
    /// its cutter stands, at a chunk's start (a window's, or the stretch's).
    pending: Option<u64>,
    /// Unchanged pages of the open stretch being read back, in address order, which the
    /// cutter holds as zeros.
    holes: VecDeque<Hole>,
    /// Unchanged pages of the open stretch read from the stopped tree, by address, until their
    /// window is cut (`tree_pages.rs`).
    from_tree: HashMap<u64, Vec<u8>>,
}

/// What the cutter holds where unchanged pages are still being read back.
static ZEROS: [u8; CHUNK] = [0; CHUNK];

/// Where the window holding `addr` ends.
pub(super) fn window_end(addr: u64) -> u64 {
    (addr / CHUNK as u64 + 1) * CHUNK as u64
}

impl Building {
    /// Chunks `windows` into the image.
    fn take<W: WindowSink>(
        image: &mut MemoryImage,
        writer: &mut W,
        windows: &[Cow<'_, [u8]>],
    ) -> Result<(), ChunkingError<W::Error>> {
        if windows.is_empty() {
            return Ok(());
        }
        let windows: Vec<&[u8]> = windows.iter().map(|w| w.as_ref()).collect();
        image.chunks.extend(writer.take(&windows).map_err(ChunkingError::Sink)?);
        Ok(())
    }

    /// Chunks the windows the cutter completed, the first starting at `start`, in order: a
    /// window holding pages still being read back is set aside with its place kept.
    fn emit<W: WindowSink>(
        &mut self,
        writer: &mut W,
        back: &mut ReadBack,
        windows: Vec<Cow<'_, [u8]>>,
        mut start: u64,
    ) -> Result<(), ChunkingError<W::Error>> {
        let mut ready = Vec::with_capacity(windows.len());
        for window in windows {
            let end = start + window.len() as u64;
            let mut holes = Vec::new();
            while self.holes.front().is_some_and(|hole| hole.start < end) {
                holes.extend(self.holes.pop_front());
            }
            if holes.is_empty() {
                ready.push(window);
            } else {
                Self::take(&mut self.image, writer, &std::mem::take(&mut ready))?;
                let place = (self.image.dst_id, self.image.chunks.len(), start);
                self.image.chunks.push(ChunkRef::default());
                back.set_aside(writer, place, window.into_owned(), holes)?;
            }
            start = end;
        }
        Self::take(&mut self.image, writer, &ready)
    }

    /// Takes written pages, `pieces`, continuing the open stretch.
    fn written<W: WindowSink>(
        &mut self,
        writer: &mut W,
        back: &mut ReadBack,
        pieces: &[&[u8]],
    ) -> Result<(), ChunkingError<W::Error>> {
        self.settle(writer, back)?;
        let (_, cutter) = self.open.as_mut().expect("a stretch is open");
        let start = cutter.window_start();
        let windows: Vec<Cow<'_, [u8]>> = pieces.iter().flat_map(|piece| cutter.cut(piece)).collect();
        self.emit(writer, back, windows, start)
    }

    /// Takes the unchanged pages `start..end`, continuing the open stretch: each whole chunk
    /// of them as the previous checkpoint had it where it had the same, read back where not;
    /// their last part waits for what follows (more unchanged pages, written ones, or the end).
    fn unchanged<W: WindowSink>(
        &mut self,
        writer: &mut W,
        back: &mut ReadBack,
        start: u64,
        end: u64,
    ) -> Result<(), ChunkingError<W::Error>> {
        if self.pending.is_none() && self.open.as_ref().is_some_and(|(_, cutter)| cutter.within_window()) {
            // A window begun with written pages: its unchanged rest.
            self.unchanged_part(writer, back, start, window_end(start).min(end))?;
        }
        let mut at = self.open.as_ref().expect("a stretch is open").1.addr();
        while at < end && window_end(at) <= end {
            self.unchanged_part(writer, back, at, window_end(at))?;
            at = window_end(at);
        }
        self.pending = (at < end).then_some(end);
        Ok(())
    }

    /// Unchanged pages `start..end` of one window, continuing the open stretch: referenced
    /// as the previous checkpoint has them (`ParentMemory::references`), written pages
    /// before them in the window then ending a chunk of their own; else their bytes read back
    /// and chunked with the window's written ones.
    fn unchanged_part<W: WindowSink>(
        &mut self,
        writer: &mut W,
        back: &mut ReadBack,
        start: u64,
        end: u64,
    ) -> Result<(), ChunkingError<W::Error>> {
        let dst_id = self.image.dst_id;
        let refs = match back.memory().and_then(|memory| memory.references(dst_id, start, end)) {
            Some(References::AsTheyWere(chunks)) => chunks,
            Some(References::Part(chunk)) => {
                writer.stats().bytes_in_part += end - start;
                vec![chunk]
            }
            None => return self.read_back(writer, back, start, end),
        };
        let (_, cutter) = self.open.as_mut().expect("a stretch is open");
        let first = cutter.window_start();
        if let Some(written) = cutter.end_piece() {
            self.emit(writer, back, vec![Cow::Owned(written)], first)?;
        }
        for chunk in refs {
            writer.stats().count_known(&chunk);
            self.image.chunks.push(chunk);
        }
        // Bytes the tree gave for them, if it did, are not needed.
        self.from_tree.remove(&start);
        self.open.as_mut().expect("a stretch is open").1.skip(end - start);
        Ok(())
    }

    /// The unchanged pages `start..end`, continuing the open stretch, as the stopped tree
    /// gave them or else read back from the previous checkpoint (one read per window, running
    /// while the dump goes on), and chunked as written ones are.
    fn read_back<W: WindowSink>(
        &mut self,
        writer: &mut W,
        back: &mut ReadBack,
        start: u64,
        end: u64,
    ) -> Result<(), ChunkingError<W::Error>> {
        let mut at = start;
        while at < end {
            let to = window_end(at).min(end);
            let part: Cow<'_, [u8]> =
                match self.from_tree.remove(&at).filter(|read| read.len() as u64 == to - at) {
                    Some(read) => {
                        writer.stats().bytes_from_tree += to - at;
                        Cow::Owned(read)
                    }
                    None => {
                        self.holes.push_back(back.ask(self.image.dst_id, at, to)?);
                        Cow::Borrowed(&ZEROS[..(to - at) as usize])
                    }
                };
            let (_, cutter) = self.open.as_mut().expect("a stretch is open");
            let first = cutter.window_start();
            let windows = cutter.cut(&part);
            self.emit(writer, back, windows, first)?;
            at = to;
        }
        Ok(())
    }

    /// Unchanged pages waiting at the end of the open stretch are read back and chunked:
    /// written pages continue their window.
    fn settle<W: WindowSink>(
        &mut self,
        writer: &mut W,
        back: &mut ReadBack,
    ) -> Result<(), ChunkingError<W::Error>> {
        let (Some(end), Some((_, cutter))) = (self.pending.take(), self.open.as_ref()) else {
            return Ok(());
        };
        let start = cutter.addr();
        self.unchanged_part(writer, back, start, end)
    }

    fn close<W: WindowSink>(
        &mut self,
        writer: &mut W,
        back: &mut ReadBack,
    ) -> Result<(), ChunkingError<W::Error>> {
        if let Some(end) = self.pending.take() {
            // The stretch ends in unchanged pages: its last chunk, as it was if it was the same.
            let start = self.open.as_ref().expect("pages wait in an open stretch").1.addr();
            self.unchanged_part(writer, back, start, end)?;
        }
        if let Some((run, cutter)) = self.open.take() {
            let run = StoredRun { vaddr: run.vaddr, nr_pages: run.nr_pages, flags: run.flags };
            self.image.runs.push(run);
            let start = cutter.window_start();
            if let Some(last) = cutter.finish() {
                self.emit(writer, back, vec![Cow::Owned(last)], start)?;
            }
        }
        debug_assert!(self.holes.is_empty(), "a closed stretch's reads back are all in windows");
        // Pieces the tree gave that a window did not need (the previous checkpoint had its chunk).
        self.from_tree.clear();
        Ok(())
    }
}

impl MemoryChunker {
    /// A chunker whose dump's runs in parent are `parent`'s pages.
    pub(super) fn new(parent: Option<Parent>) -> Self {
        MemoryChunker { back: ReadBack::new(parent), ..Default::default() }
    }

    /// The image of `dst_id`, made empty when it is new: an image CRIU opened is kept even if
    /// no run of it comes (a shared anonymous mapping never written), as CRIU's restore
    /// wants its pagemap.
    pub(super) fn image(&mut self, dst_id: u64) -> &mut Building {
        self.images.entry(dst_id).or_insert_with(|| {
            self.order.push(dst_id);
            Building {
                image: MemoryImage { dst_id, ..Default::default() },
                open: None,
                pending: None,
                holes: VecDeque::new(),
                from_tree: HashMap::new(),
            }
        })
    }

    /// Takes `run`, whose bytes are `pieces` in order (none for a run without data). A run in
    /// parent is stored as the previous checkpoint had its pages, with their flags: a page
    /// CRIU may leave to a lazy restore then still is one, as in a full dump (were it not,
    /// CRIU would put it in place itself on a restore, and with transparent huge pages that
    /// fills the lazy pages around it with zeros the restore never replaces).
    pub(super) fn feed<W: WindowSink>(
        &mut self,
        writer: &mut W,
        run: PageRun,
        pieces: &[&[u8]],
    ) -> Result<(), ChunkingError<W::Error>> {
        if run.flags & PE_PARENT == 0 {
            return self.feed_one(writer, run, false, pieces);
        }
        let end = run.vaddr + run.byte_len();
        let parts = self.back.memory().and_then(|m| m.flags_over(run.dst_id, run.vaddr, end));
        let Some(parts) = parts else {
            let checkpoint = self.back.memory().map_or("(none)", |m| m.checkpoint()).into();
            let (dst_id, vaddr, nr_pages) = (run.dst_id, run.vaddr, run.nr_pages);
            return Err(ParentError::NotHeld { checkpoint, dst_id, vaddr, nr_pages }.into());
        };
        writer.stats().bytes_unchanged += run.byte_len();
        for (start, end, flags) in parts {
            let part = PageRun { vaddr: start, nr_pages: (end - start) / PAGE_SIZE, flags, ..run };
            self.feed_one(writer, part, true, &[])?;
        }
        Ok(())
    }

    /// Takes `run`, unchanged pages with the flags they had, or written ones.
    fn feed_one<W: WindowSink>(
        &mut self,
        writer: &mut W,
        run: PageRun,
        in_parent: bool,
        pieces: &[&[u8]],
    ) -> Result<(), ChunkingError<W::Error>> {
        self.image(run.dst_id);
        let building = self.images.get_mut(&run.dst_id).expect("just made");
        let back = &mut self.back;
        if !building.open.as_ref().is_some_and(|(open, _)| open.continued_by(&run)) {
            building.close(writer, back)?;
            building.open = Some((PageRun { nr_pages: 0, ..run }, WindowCutter::new(run.vaddr)));
        }
        building.open.as_mut().expect("a stretch is open").0.nr_pages += run.nr_pages;
        match in_parent {
            false => building.written(writer, back, pieces),
            true => building.unchanged(writer, back, run.vaddr, run.vaddr + run.byte_len()),
        }
    }

    /// Takes what the page server passed on: an image opened, a block of runs, or unchanged
    /// pages read from the tree for a block to come. Returns the bytes of a block's pages.
    pub(super) fn receive<W: WindowSink>(
        &mut self,
        writer: &mut W,
        received: Received<'_>,
    ) -> Result<u64, ChunkingError<W::Error>> {
        match received {
            Received::Opened(dst_id) => {
                self.image(dst_id);
                Ok(0)
            }
            Received::Block(block) => {
                self.feed(writer, block.run, &[block.bytes()])?;
                Ok(block.bytes().len() as u64)
            }
            Received::Unchanged(piece) => {
                self.image(piece.dst_id).from_tree.insert(piece.start, piece.bytes);
                Ok(0)
            }
        }
    }

    pub(super) fn finish<W: WindowSink>(
        mut self,
        writer: &mut W,
    ) -> Result<Vec<MemoryImage>, ChunkingError<W::Error>> {
        for dst_id in &self.order {
            let building = self.images.get_mut(dst_id).expect("every destination has an image");
            building.close(writer, &mut self.back)?;
        }
        for (dst_id, index, chunk) in self.back.finish(writer)? {
            self.images.get_mut(&dst_id).expect("windows are set aside of known images").image.chunks
                [index] = chunk;
        }
        let mut images = Vec::with_capacity(self.order.len());
        for dst_id in self.order {
            images.push(self.images.remove(&dst_id).expect("every destination has an image").image);
        }
        Ok(images)
    }
}

/// Bytes of staged runs of one stretch taken together: hashed and compressed as one parallel
/// batch, and, where spilled, let go after it, so that reading back a long stretch (one large
/// mapping) never maps all of its spill file at once.
const GROUP: u64 = 64 << 20;

/// The memory images of a staged dump, runs that continue one another taken together up to
/// [`GROUP`] bytes.
pub(super) fn staged_images(
    staged: &Staged,
    writer: &mut ChunkWriter<'_>,
    advance: &mut dyn FnMut(u64),
) -> Result<Vec<MemoryImage>, ChunkingError<UploaderGone>> {
    let mut chunker = MemoryChunker::default();
    for &dst_id in staged.opened() {
        chunker.image(dst_id);
    }
    let runs = staged.runs();
    let mut start = 0;
    while start < runs.len() {
        let (mut end, mut bytes) = (start + 1, runs[start].run.byte_len());
        while end < runs.len() && bytes < GROUP && runs[end - 1].run.continued_by(&runs[end].run) {
            bytes += runs[end].run.byte_len();
            end += 1;
        }
        let joined = &runs[start..end];
        let run = PageRun { nr_pages: joined.iter().map(|r| r.run.nr_pages).sum(), ..joined[0].run };
        let pieces: Vec<&[u8]> = joined.iter().map(|r| staged.bytes(r)).collect();
        chunker.feed(writer, run, &pieces)?;
        joined.iter().for_each(|r| staged.release(r));
        advance(pieces.iter().map(|p| p.len() as u64).sum());
        start = end;
    }
    chunker.finish(writer)
}

/// Why a streamed dump's memory images could not be made.
#[derive(Debug)]
pub(super) enum StreamFailure {
    Chunking(ChunkingError<UploaderGone>),
    Unfinished(Unfinished),
}

/// The memory images of a dump streamed while CRIU sends it, made as its blocks arrive; its
/// runs in parent are `parent`'s pages.
pub(super) fn streamed_images(
    source: StreamSource,
    parent: Option<Parent>,
    writer: &mut ChunkWriter<'_>,
    advance: &mut dyn FnMut(u64),
) -> Result<Vec<MemoryImage>, StreamFailure> {
    let mut chunker = MemoryChunker::new(parent);
    let taken = source.each(|received| {
        advance(chunker.receive(writer, received)?);
        Ok(())
    });
    match taken {
        Ok(()) => chunker.finish(writer).map_err(StreamFailure::Chunking),
        Err(Ok(unfinished)) => Err(StreamFailure::Unfinished(unfinished)),
        Err(Err(failed)) => Err(StreamFailure::Chunking(failed)),
    }
}
