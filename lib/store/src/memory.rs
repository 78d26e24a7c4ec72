//! A dump's memory images from the pages CRIU sent: runs joined into stretches, stretches cut
//! into chunks at aligned windows.
//!
//! CRIU cuts its transfers where its page-pipe buffers fill up, and those places move as soon
//! as an earlier mapping gains or loses a page. Joined, a stored run is a stretch of present
//! pages of the task's memory, and each chunk the part of an aligned window that stretch
//! covers: the same memory gives the same chunks wherever CRIU cut it, and whether it was
//! staged whole, sifted as it arrived, or streamed in blocks.

use std::borrow::Cow;
use std::collections::HashMap;

use stasis_proto::stasis::store::v1::{ChunkRef, MemoryImage, PageRun as StoredRun};

use super::chunks::{ChunkWriter, UploaderGone, WindowCutter};
use super::staging::Staged;
use super::stream::{Received, StreamSource, Unfinished};
use stasis_criu_images::pages::PageRun;

/// Where the windows of a memory image go, each coming back as its chunk's reference: the
/// store's chunk writer (a streamed dump), or a sifter staging what the store lacks.
pub(super) trait WindowSink {
    type Error;

    /// References to `windows` (each at most one chunk), in order.
    fn take(&mut self, windows: &[&[u8]]) -> Result<Vec<ChunkRef>, Self::Error>;
}

impl WindowSink for ChunkWriter<'_> {
    type Error = UploaderGone;

    fn take(&mut self, windows: &[&[u8]]) -> Result<Vec<ChunkRef>, UploaderGone> {
        self.write(windows)
    }
}

/// Builds the memory images of one dump from runs in CRIU's order (per destination; the
/// destinations may interleave).
#[derive(Default)]
pub(super) struct MemoryChunker {
    /// Destinations in the order their first run came.
    order: Vec<u64>,
    images: HashMap<u64, Building>,
}

pub(super) struct Building {
    image: MemoryImage,
    /// The stretch the next run may continue: the pages so far, and its last partial window.
    open: Option<(PageRun, WindowCutter)>,
}

impl Building {
    fn close<W: WindowSink>(&mut self, writer: &mut W) -> Result<(), W::Error> {
        if let Some((run, cutter)) = self.open.take() {
            let run = StoredRun { vaddr: run.vaddr, nr_pages: run.nr_pages, flags: run.flags };
            self.image.runs.push(run);
            if let Some(last) = cutter.finish() {
                self.image.chunks.extend(writer.take(&[&last])?);
            }
        }
        Ok(())
    }
}

impl MemoryChunker {
    /// The image of `dst_id`, made empty when it is new: an image CRIU opened is kept even if
    /// no run of it comes (a shared anonymous mapping never written), as CRIU's restore
    /// wants its pagemap.
    pub(super) fn image(&mut self, dst_id: u64) -> &mut Building {
        self.images.entry(dst_id).or_insert_with(|| {
            self.order.push(dst_id);
            Building { image: MemoryImage { dst_id, ..Default::default() }, open: None }
        })
    }

    /// Takes `run`, whose bytes are `pieces` in order (none for a run without data).
    pub(super) fn feed<W: WindowSink>(
        &mut self,
        writer: &mut W,
        run: PageRun,
        pieces: &[&[u8]],
    ) -> Result<(), W::Error> {
        let building = self.image(run.dst_id);
        if !building.open.as_ref().is_some_and(|(open, _)| open.continued_by(&run)) {
            building.close(writer)?;
            building.open = Some((PageRun { nr_pages: 0, ..run }, WindowCutter::new(run.vaddr)));
        }
        let (open, cutter) = building.open.as_mut().expect("a stretch is open");
        open.nr_pages += run.nr_pages;
        let windows: Vec<Cow<'_, [u8]>> = pieces.iter().flat_map(|piece| cutter.cut(piece)).collect();
        building.image.chunks.extend(writer.take(&windows.iter().map(|w| w.as_ref()).collect::<Vec<_>>())?);
        Ok(())
    }

    pub(super) fn finish<W: WindowSink>(mut self, writer: &mut W) -> Result<Vec<MemoryImage>, W::Error> {
        let mut images = Vec::with_capacity(self.order.len());
        for dst_id in self.order {
            let mut building = self.images.remove(&dst_id).expect("every destination has an image");
            building.close(writer)?;
            images.push(building.image);
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
) -> Result<Vec<MemoryImage>, UploaderGone> {
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
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(super) enum StreamFailure {
    Uploader(UploaderGone),
    Unfinished(Unfinished),
}

/// The memory images of a dump streamed while CRIU sends it, made as its blocks arrive.
pub(super) fn streamed_images(
    source: StreamSource,
    writer: &mut ChunkWriter<'_>,
    advance: &mut dyn FnMut(u64),
) -> Result<Vec<MemoryImage>, StreamFailure> {
    let mut chunker = MemoryChunker::default();
    let taken = source.each(|received| {
        match received {
            Received::Opened(dst_id) => {
                chunker.image(dst_id);
            }
            Received::Block(block) => {
                chunker.feed(writer, block.run, &[block.bytes()])?;
                advance(block.bytes().len() as u64);
            }
        }
        Ok(())
    });
    match taken {
        Ok(()) => chunker.finish(writer).map_err(StreamFailure::Uploader),
        Err(Ok(unfinished)) => Err(StreamFailure::Unfinished(unfinished)),
        Err(Err(gone)) => Err(StreamFailure::Uploader(gone)),
    }
}
