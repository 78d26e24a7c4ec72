//! Windows that mix pages written since the previous checkpoint with unchanged ones, set aside
//! while their unchanged pages are read back from it.
//!
//! A job that writes a word here and there over its memory leaves a mixed window at every
//! write. Read one after another, each costs the chunker a store read (a request to object
//! storage, or under emulation tens of milliseconds) while CRIU waits and the tree stays
//! frozen. Instead the chunker asks for those pages, cuts the window with zeros in their
//! place, and sets it aside, keeping its reference's place in the image; it goes on with the
//! pages that follow while the reads run on the store's runtime. A window set aside is
//! completed (its holes filled, then hashed and stored like any other) when more than
//! [`WAITING`] wait ([`TOGETHER`] at a time), and all of them at the end of the dump.

use std::collections::VecDeque;

use stasis_proto::stasis::store::v1::ChunkRef;

use super::memory::{ChunkingError, WindowSink};
use super::parent::{Parent, ParentError, ParentMemory, Pending};

/// Windows set aside at most: their reads run at the same time. Each holds its window and
/// the previous checkpoint's chunk once read, 128 KiB at most.
const WAITING: usize = 64;
/// Windows completed together, the oldest first: the sink hashes and compresses them as one
/// batch, in parallel.
const TOGETHER: usize = 16;

/// Bytes of an open stretch still being read from the previous checkpoint, within one window:
/// the cutter holds zeros in their place.
pub(super) struct Hole {
    pub start: u64,
    pub bytes: Pending,
}

/// A window set aside until its holes are read.
struct Waiting {
    dst_id: u64,
    /// Its reference's place among its image's chunks.
    index: usize,
    /// Address of its first byte.
    start: u64,
    bytes: Vec<u8>,
    holes: Vec<Hole>,
}

/// A completed window's reference: its image, its place among the image's chunks, itself.
pub(super) type Completed = (u64, usize, ChunkRef);

/// The previous checkpoint a dump's runs in parent come from, and the windows waiting for it.
#[derive(Default)]
pub(super) struct ReadBack {
    parent: Option<Parent>,
    waiting: VecDeque<Waiting>,
    /// The windows completed.
    done: Vec<Completed>,
}

impl ReadBack {
    pub fn new(parent: Option<Parent>) -> Self {
        ReadBack { parent, ..Default::default() }
    }

    /// The previous checkpoint's memory, if the dump has one.
    pub fn memory(&self) -> Option<&ParentMemory> {
        self.parent.as_ref().map(|p| &*p.memory)
    }

    /// Asks for the unchanged pages `start..end` of image `dst_id` (within one window).
    pub fn ask(&mut self, dst_id: u64, start: u64, end: u64) -> Result<Hole, ParentError> {
        let parent = self.parent.as_mut().expect("pages are read back only in a dump with a parent");
        Ok(Hole { start, bytes: parent.ask(dst_id, start, end)? })
    }

    /// Sets aside the window at `start` of image `dst_id`, whose reference goes at `index`,
    /// until `holes` are read; completes the oldest windows while too many wait.
    pub fn set_aside<W: WindowSink>(
        &mut self,
        writer: &mut W,
        (dst_id, index, start): (u64, usize, u64),
        bytes: Vec<u8>,
        holes: Vec<Hole>,
    ) -> Result<(), ChunkingError<W::Error>> {
        self.waiting.push_back(Waiting { dst_id, index, start, bytes, holes });
        if self.waiting.len() > WAITING {
            self.complete_oldest(writer)?;
        }
        Ok(())
    }

    /// Completes every window set aside, and returns the references of all completed, each
    /// with its image and place.
    pub fn finish<W: WindowSink>(
        mut self,
        writer: &mut W,
    ) -> Result<Vec<Completed>, ChunkingError<W::Error>> {
        while !self.waiting.is_empty() {
            self.complete_oldest(writer)?;
        }
        Ok(self.done)
    }

    /// Fills the holes of the oldest windows (up to [`TOGETHER`]) as their reads arrive, and
    /// stores them.
    fn complete_oldest<W: WindowSink>(&mut self, writer: &mut W) -> Result<(), ChunkingError<W::Error>> {
        let count = self.waiting.len().min(TOGETHER);
        let mut filled = Vec::with_capacity(count);
        for Waiting { dst_id, index, start, mut bytes, holes } in self.waiting.drain(..count) {
            for hole in holes {
                let read = hole.bytes.wait()?;
                let at = (hole.start - start) as usize;
                bytes[at..at + read.len()].copy_from_slice(&read);
            }
            filled.push((dst_id, index, bytes));
        }
        let windows: Vec<&[u8]> = filled.iter().map(|(_, _, bytes)| bytes.as_slice()).collect();
        let refs = writer.take(&windows).map_err(ChunkingError::Sink)?;
        assert_eq!(refs.len(), filled.len(), "a window sink gives one reference per window");
        self.done.extend(
            filled.into_iter().zip(refs).map(|((dst_id, index, _), reference)| (dst_id, index, reference)),
        );
        Ok(())
    }
}
