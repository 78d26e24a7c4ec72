//! Storing a dump while CRIU sends it, for a tree that will not run on (an eviction, a
//! migration): its durable time is what counts, not how long it stays frozen.
//!
//! The page server's thread reads pages into blocks from a small pool of buffers and hands
//! them to the store's chunker, which returns each buffer once its windows are stored. So
//! hashing, compression and upload overlap the dump, nothing is staged whole, and the buffers'
//! pages are faulted in once rather than for every gigabyte received. When the store falls
//! behind, the pool runs dry and CRIU waits; when the store fails, the page server's next
//! block is refused, CRIU's dump fails and the tree runs on.

use std::io::{self, Read};
use std::sync::mpsc::{Receiver, SyncSender, sync_channel};

use crate::criu::pageserver::{PAGE_SIZE, PageRun, PageSink};

/// Bytes of one block: several of CRIU's transfers, so that a block's windows make a batch
/// worth hashing and compressing in parallel.
const BLOCK: usize = 8 << 20;
/// Buffers in the pool: what a streamed dump holds in memory, beyond the packs being filled.
const BLOCKS: usize = 6;

/// Pages of one destination that follow each other, with one set of flags.
#[derive(Debug)]
pub struct Block {
    pub run: PageRun,
    /// A pooled buffer, or empty for runs without data.
    buf: Vec<u8>,
}

impl Block {
    pub fn bytes(&self) -> &[u8] {
        if self.run.has_data() { &self.buf[..self.run.byte_len() as usize] } else { &[] }
    }
}

enum Message {
    Block(Block),
    /// The dump succeeded and every page was sent.
    End,
}

/// The page server's side: a [`PageSink`] that passes pages on in blocks.
pub struct StreamSink {
    current: Option<Block>,
    blocks: SyncSender<Message>,
    free: Receiver<Vec<u8>>,
}

/// The store's side: the blocks as they arrive.
pub struct StreamSource {
    blocks: Receiver<Message>,
    free: SyncSender<Vec<u8>>,
}

/// The stream ended without [`StreamSink::finish`]: the dump failed or the page server stopped.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Unfinished;

/// A connected sink and source, with the buffer pool between them.
pub fn stream() -> (StreamSink, StreamSource) {
    let (free_tx, free_rx) = sync_channel(BLOCKS);
    for _ in 0..BLOCKS {
        // Zeroed by the allocator's fresh mapping: untouched pages cost nothing until used.
        free_tx.send(vec![0u8; BLOCK]).expect("the pool has room for every buffer");
    }
    let (blocks_tx, blocks_rx) = sync_channel(BLOCKS);
    (
        StreamSink { current: None, blocks: blocks_tx, free: free_rx },
        StreamSource { blocks: blocks_rx, free: free_tx },
    )
}

fn store_stopped() -> io::Error {
    io::Error::other("the store stopped taking pages")
}

impl StreamSink {
    /// Passes on the last block and marks the stream complete. Only after a successful dump.
    pub fn finish(mut self) -> io::Result<()> {
        self.ship()?;
        self.blocks.send(Message::End).map_err(|_| store_stopped())
    }

    fn ship(&mut self) -> io::Result<()> {
        match self.current.take() {
            Some(block) => self.blocks.send(Message::Block(block)).map_err(|_| store_stopped()),
            None => Ok(()),
        }
    }

    fn continues(&self, run: &PageRun) -> bool {
        self.current.as_ref().is_some_and(|b| {
            b.run.dst_id == run.dst_id
                && b.run.flags == run.flags
                && b.run.vaddr + b.run.byte_len() == run.vaddr
        })
    }
}

impl PageSink for StreamSink {
    fn run(&mut self, run: PageRun, data: &mut dyn Read) -> io::Result<()> {
        if !self.continues(&run) {
            self.ship()?;
        }
        if !run.has_data() {
            let block =
                self.current.get_or_insert(Block { run: PageRun { nr_pages: 0, ..run }, buf: Vec::new() });
            block.run.nr_pages += run.nr_pages;
            return Ok(());
        }
        let (mut vaddr, mut left) = (run.vaddr, run.nr_pages);
        while left > 0 {
            if self.current.is_none() {
                let buf = self.free.recv().map_err(|_| store_stopped())?;
                self.current = Some(Block { run: PageRun { vaddr, nr_pages: 0, ..run }, buf });
            }
            let block = self.current.as_mut().expect("a block was just started");
            let used = block.run.byte_len() as usize;
            let pages = ((BLOCK - used) as u64 / PAGE_SIZE).min(left);
            let len = (pages * PAGE_SIZE) as usize;
            data.read_exact(&mut block.buf[used..used + len])?;
            block.run.nr_pages += pages;
            (vaddr, left) = (vaddr + pages * PAGE_SIZE, left - pages);
            if used + len == BLOCK {
                self.ship()?;
            }
        }
        Ok(())
    }
}

impl StreamSource {
    /// Calls `take` with every block in order, giving each buffer back to the pool after it.
    /// `Err(Ok(Unfinished))` when the stream ended before [`StreamSink::finish`];
    /// `Err(Err(e))` when `take` failed (the sink then sees the store stopped).
    pub fn each<E>(self, mut take: impl FnMut(&Block) -> Result<(), E>) -> Result<(), Result<Unfinished, E>> {
        for message in self.blocks.iter() {
            match message {
                Message::End => return Ok(()),
                Message::Block(block) => {
                    take(&block).map_err(Err)?;
                    if block.buf.len() == BLOCK {
                        // The sink may be gone already; then the buffer is simply freed.
                        let _ = self.free.try_send(block.buf);
                    }
                }
            }
        }
        Err(Ok(Unfinished))
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::criu::pageserver::PE_PRESENT;

    const PAGE: usize = PAGE_SIZE as usize;

    fn run(dst_id: u64, vaddr: u64, nr_pages: u64, flags: u32) -> PageRun {
        PageRun { dst_id, vaddr, nr_pages, flags }
    }

    #[test]
    fn runs_are_joined_into_blocks_and_split_at_the_block_size() {
        let (mut sink, source) = stream();
        let pages = BLOCK / PAGE;
        let data: Vec<u8> = (0..(pages + 3) * PAGE).map(|i| (i / PAGE) as u8).collect();
        let consumer = std::thread::spawn(move || {
            let mut got = Vec::new();
            let end = source.each(|b| {
                got.push((b.run, b.bytes().to_vec()));
                Ok::<_, ()>(())
            });
            (end, got)
        });
        // Two runs that continue each other and cross the block size, then a hole, then
        // another destination.
        sink.run(run(1, 0x10000, 2, PE_PRESENT), &mut &data[..2 * PAGE]).unwrap();
        sink.run(run(1, 0x12000, (pages + 1) as u64, PE_PRESENT), &mut &data[2 * PAGE..]).unwrap();
        sink.run(run(1, 0x9_0000_0000, 4, 0), &mut &[][..]).unwrap();
        sink.run(run(2, 0x10000, 1, PE_PRESENT), &mut &data[..PAGE]).unwrap();
        sink.finish().unwrap();
        let (end, got) = consumer.join().unwrap();
        assert_eq!(end, Ok(()));
        let runs: Vec<PageRun> = got.iter().map(|(r, _)| *r).collect();
        assert_eq!(
            runs,
            [
                run(1, 0x10000, pages as u64, PE_PRESENT),
                run(1, 0x10000 + BLOCK as u64, 3, PE_PRESENT),
                run(1, 0x9_0000_0000, 4, 0),
                run(2, 0x10000, 1, PE_PRESENT),
            ]
        );
        let joined: Vec<u8> = got[..2].iter().flat_map(|(_, b)| b.clone()).collect();
        assert_eq!(joined, data, "the bytes arrive whole and in order");
        assert!(got[2].1.is_empty());
    }

    #[test]
    fn a_stream_without_finish_is_unfinished_and_a_failed_store_stops_the_sink() {
        let (mut sink, source) = stream();
        let data = vec![7u8; PAGE];
        sink.run(run(1, 0, 1, PE_PRESENT), &mut &data[..]).unwrap();
        drop(sink);
        assert_eq!(source.each(|_| Ok::<_, ()>(())), Err(Ok(Unfinished)));

        let (mut sink, source) = stream();
        let consumer = std::thread::spawn(move || source.each(|_| Err("store down")));
        let full = vec![1u8; BLOCK];
        sink.run(run(1, 0, (BLOCK / PAGE) as u64, PE_PRESENT), &mut &full[..]).unwrap();
        assert_eq!(consumer.join().unwrap(), Err(Err("store down")));
        sink.run(run(1, BLOCK as u64, 1, PE_PRESENT), &mut &data[..]).unwrap();
        assert!(sink.finish().is_err(), "the sink learns that the store stopped");
    }
}
