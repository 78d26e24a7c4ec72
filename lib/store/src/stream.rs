//! Storing a dump while CRIU sends it, for a tree that will not run on (an eviction, a
//! migration): its durable time is what counts, not how long it stays frozen.
//!
//! The page server's thread reads pages into blocks from a daemon-wide pool of buffers and
//! hands them to the store's chunker, which gives each buffer back once its windows are
//! stored. So hashing, compression and upload overlap the dump, nothing is staged whole, the
//! buffers' pages are faulted in once rather than for every gigabyte received, and the
//! memory this takes is the pool's however many evictions run at once. When the store falls
//! behind, the pool runs dry and CRIU waits; when the store fails, the page server's next
//! block is refused, CRIU's dump fails and the tree runs on.

use std::io::{self, Read};
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::mpsc::{Receiver, SyncSender, sync_channel};
use std::sync::{Arc, Condvar, Mutex};
use std::time::Duration;

use stasis_criu_images::pages::{PAGE_SIZE, PageRun, PageSink};

use super::parent::ParentMemory;
use super::tree_pages::{FromTree, TreeMemory, TreePiece};

/// Bytes of one block: several of CRIU's transfers, so that a block's windows make a batch
/// worth hashing and compressing in parallel.
const BLOCK: usize = 8 << 20;
/// Buffers in the pool, shared by every streamed dump: what they hold in memory beyond the
/// packs being filled.
pub const BLOCKS: usize = 6;
/// How often a sink waiting for a buffer checks that its store still takes pages.
const STOPPED_CHECK: Duration = Duration::from_millis(50);

/// The buffers streamed dumps fill, made as first needed, up to [`BLOCKS`].
#[derive(Debug, Clone, Default)]
pub struct BlockPool {
    inner: Arc<PoolInner>,
}

#[derive(Debug, Default)]
struct PoolInner {
    free: Mutex<Free>,
    returned: Condvar,
}

#[derive(Debug, Default)]
struct Free {
    buffers: Vec<Vec<u8>>,
    made: usize,
}

impl BlockPool {
    /// A buffer, once one is free; `None` if `stopped` is set meanwhile.
    fn take(&self, stopped: &AtomicBool) -> Option<Buffer> {
        let mut free = self.inner.free.lock().unwrap_or_else(|p| p.into_inner());
        loop {
            if stopped.load(Ordering::Acquire) {
                return None;
            }
            if let Some(bytes) = free.buffers.pop() {
                return Some(Buffer { bytes, pool: self.clone() });
            }
            if free.made < BLOCKS {
                free.made += 1;
                // Zeroed by the allocator's fresh mapping: untouched pages cost nothing yet.
                return Some(Buffer { bytes: vec![0u8; BLOCK], pool: self.clone() });
            }
            free = self.inner.returned.wait_timeout(free, STOPPED_CHECK).unwrap_or_else(|p| p.into_inner()).0;
        }
    }
}

/// A buffer of the pool, given back when dropped.
#[derive(Debug)]
struct Buffer {
    bytes: Vec<u8>,
    pool: BlockPool,
}

impl Drop for Buffer {
    fn drop(&mut self) {
        let bytes = std::mem::take(&mut self.bytes);
        let inner = &self.pool.inner;
        inner.free.lock().unwrap_or_else(|p| p.into_inner()).buffers.push(bytes);
        inner.returned.notify_one();
    }
}

/// Pages of one destination that follow each other, with one set of flags.
#[derive(Debug)]
pub struct Block {
    pub run: PageRun,
    /// A pooled buffer; none for runs without data.
    buf: Option<Buffer>,
}

impl Block {
    pub fn bytes(&self) -> &[u8] {
        match &self.buf {
            Some(buf) if self.run.has_data() => &buf.bytes[..self.run.byte_len() as usize],
            _ => &[],
        }
    }
}

enum Message {
    /// CRIU opened a memory image (a page-server destination id); runs of it may follow.
    Opened(u64),
    Block(Block),
    Unchanged(TreePiece),
    /// The dump succeeded and every page was sent.
    End,
}

/// What the store's side takes, in the order CRIU sent it.
#[derive(Debug)]
pub enum Received<'a> {
    /// A memory image CRIU opened, which the dump has even if no page of it follows.
    Opened(u64),
    Block(&'a Block),
    /// Unchanged pages read from the stopped tree, ahead of the block whose windows need them.
    Unchanged(TreePiece),
}

/// The page server's side: a [`PageSink`] that passes pages on in blocks.
pub struct StreamSink {
    current: Option<Block>,
    /// The run of the block shipped last.
    shipped: Option<PageRun>,
    blocks: SyncSender<Message>,
    pool: BlockPool,
    stopped: Arc<AtomicBool>,
    tree: Option<FromTree>,
}

/// The store's side: the blocks as they arrive.
pub struct StreamSource {
    blocks: Receiver<Message>,
    stopped: Arc<AtomicBool>,
}

impl Drop for StreamSource {
    fn drop(&mut self) {
        self.stopped.store(true, Ordering::Release);
    }
}

/// The stream ended without [`StreamSink::finish`]: the dump failed or the page server stopped.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Unfinished;

/// A connected sink and source, filling buffers of `pool`.
pub fn stream(pool: &BlockPool) -> (StreamSink, StreamSource) {
    let (blocks_tx, blocks_rx) = sync_channel(BLOCKS);
    let stopped = Arc::new(AtomicBool::new(false));
    (
        StreamSink {
            current: None,
            shipped: None,
            blocks: blocks_tx,
            pool: pool.clone(),
            stopped: stopped.clone(),
            tree: None,
        },
        StreamSource { blocks: blocks_rx, stopped },
    )
}

fn store_stopped() -> io::Error {
    io::Error::other("the store stopped taking pages")
}

impl StreamSink {
    /// This sink, reading from `tree` (stopped while CRIU dumps it) the unchanged pages that
    /// share a window with written ones and that `parent`, the previous checkpoint, has no
    /// references for (see `tree_pages.rs`).
    pub fn reading_unchanged_from(mut self, tree: Box<dyn TreeMemory>, parent: Arc<ParentMemory>) -> Self {
        self.tree = Some(FromTree::new(tree, parent));
        self
    }

    /// Passes on the last block and marks the stream complete. Only after a successful dump.
    pub fn finish(mut self) -> io::Result<()> {
        self.close()?;
        self.blocks.send(Message::End).map_err(|_| store_stopped())
    }

    /// Passes on the block being filled, `next` the run that follows it (if one does), after
    /// the unchanged pages its windows share with written ones, read from the tree.
    fn ship(&mut self, next: Option<&PageRun>) -> io::Result<()> {
        let Some(block) = self.current.take() else { return Ok(()) };
        let pieces = self.tree.as_mut().map(|tree| tree.pieces(self.shipped.as_ref(), &block.run, next));
        for piece in pieces.into_iter().flatten() {
            self.blocks.send(Message::Unchanged(piece)).map_err(|_| store_stopped())?;
        }
        self.shipped = Some(block.run);
        self.blocks.send(Message::Block(block)).map_err(|_| store_stopped())
    }

    fn continues(&self, run: &PageRun) -> bool {
        self.current.as_ref().is_some_and(|b| b.run.continued_by(run))
    }
}

impl PageSink for StreamSink {
    /// Ships the last block while the tree is still stopped, so that its unchanged pages are
    /// read from the tree before it runs again; refuses the dump if a process read from
    /// changed meanwhile.
    fn close(&mut self) -> io::Result<()> {
        self.ship(None)?;
        self.tree.as_mut().map_or(Ok(()), FromTree::confirm)
    }

    fn open(&mut self, dst_id: u64) -> io::Result<()> {
        self.ship(None)?;
        self.blocks.send(Message::Opened(dst_id)).map_err(|_| store_stopped())
    }

    fn run(&mut self, run: PageRun, data: &mut dyn Read) -> io::Result<()> {
        if !self.continues(&run) {
            self.ship(Some(&run))?;
        }
        if !run.has_data() {
            let block = self.current.get_or_insert(Block { run: PageRun { nr_pages: 0, ..run }, buf: None });
            block.run.nr_pages += run.nr_pages;
            return Ok(());
        }
        let (mut vaddr, mut left) = (run.vaddr, run.nr_pages);
        while left > 0 {
            if self.current.is_none() {
                let buf = self.pool.take(&self.stopped).ok_or_else(store_stopped)?;
                self.current = Some(Block { run: PageRun { vaddr, nr_pages: 0, ..run }, buf: Some(buf) });
            }
            let block = self.current.as_mut().expect("a block was just started");
            let buf = &mut block.buf.as_mut().expect("a block with data has a buffer").bytes;
            let used = block.run.byte_len() as usize;
            let pages = ((BLOCK - used) as u64 / PAGE_SIZE).min(left);
            let len = (pages * PAGE_SIZE) as usize;
            data.read_exact(&mut buf[used..used + len])?;
            if let Some(tree) = &mut self.tree {
                tree.check(run.dst_id, vaddr, &buf[used..used + len]);
            }
            block.run.nr_pages += pages;
            (vaddr, left) = (vaddr + pages * PAGE_SIZE, left - pages);
            if used + len == BLOCK {
                self.ship(None)?;
            }
        }
        Ok(())
    }
}

impl StreamSource {
    /// Calls `take` with every block and opened image in order; each buffer goes back to the
    /// pool after it.
    /// `Err(Ok(Unfinished))` when the stream ended before [`StreamSink::finish`];
    /// `Err(Err(e))` when `take` failed (the sink then sees the store stopped).
    pub fn each<E>(
        self,
        mut take: impl FnMut(Received<'_>) -> Result<(), E>,
    ) -> Result<(), Result<Unfinished, E>> {
        for message in self.blocks.iter() {
            match message {
                Message::End => return Ok(()),
                Message::Opened(dst_id) => take(Received::Opened(dst_id)).map_err(Err)?,
                Message::Block(block) => take(Received::Block(&block)).map_err(Err)?,
                Message::Unchanged(piece) => take(Received::Unchanged(piece)).map_err(Err)?,
            }
        }
        Err(Ok(Unfinished))
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use stasis_criu_images::pages::PE_PRESENT;

    const PAGE: usize = PAGE_SIZE as usize;

    fn run(dst_id: u64, vaddr: u64, nr_pages: u64, flags: u32) -> PageRun {
        PageRun { dst_id, vaddr, nr_pages, flags }
    }

    #[test]
    fn runs_are_joined_into_blocks_and_split_at_the_block_size() {
        let (mut sink, source) = stream(&BlockPool::default());
        let pages = BLOCK / PAGE;
        let data: Vec<u8> = (0..(pages + 3) * PAGE).map(|i| (i / PAGE) as u8).collect();
        let consumer = std::thread::spawn(move || {
            let (mut got, mut opened) = (Vec::new(), Vec::new());
            let end = source.each(|r| {
                match r {
                    Received::Opened(dst_id) => opened.push((dst_id, got.len())),
                    Received::Block(b) => got.push((b.run, b.bytes().to_vec())),
                    Received::Unchanged(_) => unreachable!("no tree to read from"),
                }
                Ok::<_, ()>(())
            });
            (end, got, opened)
        });
        // Two runs that continue each other and cross the block size, then a hole, then
        // another destination, then one opened without runs.
        sink.open(1).unwrap();
        sink.run(run(1, 0x10000, 2, PE_PRESENT), &mut &data[..2 * PAGE]).unwrap();
        sink.run(run(1, 0x12000, (pages + 1) as u64, PE_PRESENT), &mut &data[2 * PAGE..]).unwrap();
        sink.run(run(1, 0x9_0000_0000, 4, 0), &mut &[][..]).unwrap();
        sink.open(2).unwrap();
        sink.run(run(2, 0x10000, 1, PE_PRESENT), &mut &data[..PAGE]).unwrap();
        sink.open(3).unwrap();
        sink.finish().unwrap();
        let (end, got, opened) = consumer.join().unwrap();
        assert_eq!(end, Ok(()));
        assert_eq!(opened, [(1, 0), (2, 3), (3, 4)], "each opening in its place among the blocks");
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
        let (mut sink, source) = stream(&BlockPool::default());
        let data = vec![7u8; PAGE];
        sink.run(run(1, 0, 1, PE_PRESENT), &mut &data[..]).unwrap();
        drop(sink);
        assert_eq!(source.each(|_| Ok::<_, ()>(())), Err(Ok(Unfinished)));

        let (mut sink, source) = stream(&BlockPool::default());
        let consumer = std::thread::spawn(move || source.each(|_| Err::<(), _>("store down")));
        let full = vec![1u8; BLOCK];
        sink.run(run(1, 0, (BLOCK / PAGE) as u64, PE_PRESENT), &mut &full[..]).unwrap();
        assert_eq!(consumer.join().unwrap(), Err(Err("store down")));
        let refused = sink.run(run(1, BLOCK as u64, 1, PE_PRESENT), &mut &data[..]);
        assert!(refused.is_err() || sink.finish().is_err(), "the sink learns that the store stopped");
    }

    /// A tree whose memory is all `0x11`, and whose processes changed meanwhile if `changed`.
    struct Tree {
        changed: bool,
    }

    impl TreeMemory for Tree {
        fn read(&self, _: u64, _: u64, len: usize) -> Option<Vec<u8>> {
            Some(vec![0x11; len])
        }

        fn still_the_same(&self) -> bool {
            !self.changed
        }
    }

    #[test]
    fn a_close_after_reads_of_a_process_that_changed_refuses_the_dump() {
        use stasis_criu_images::pages::PE_PARENT;
        for changed in [false, true] {
            let (sink, source) = stream(&BlockPool::default());
            let previous = Arc::new(ParentMemory::new("previous", &[]).unwrap());
            let mut sink = sink.reading_unchanged_from(Box::new(Tree { changed }), previous);
            let consumer = std::thread::spawn(move || {
                let mut from_tree = 0;
                let _ = source.each(|r| {
                    from_tree += matches!(r, Received::Unchanged(_)) as usize;
                    Ok::<_, ()>(())
                });
                from_tree
            });
            // A written page that matches the tree, then unchanged pages sharing its window.
            sink.run(run(1, 0x10000, 1, PE_PRESENT), &mut &[0x11u8; PAGE][..]).unwrap();
            sink.run(run(1, 0x11000, 3, PE_PARENT), &mut &[][..]).unwrap();
            let closed = sink.close();
            assert_eq!(closed.is_err(), changed, "{closed:?}");
            drop(sink);
            assert_eq!(consumer.join().unwrap(), 1, "the unchanged pages were read from the tree");
        }
    }

    #[test]
    fn streams_at_once_share_the_pool_and_never_make_more_buffers_than_it_holds() {
        let pool = BlockPool::default();
        let page = PAGE_SIZE as usize;
        let full = vec![3u8; BLOCK];
        let streams: Vec<_> = (0..3u64)
            .map(|dst| {
                let (mut sink, source) = stream(&pool);
                let full = full.clone();
                let sender = std::thread::spawn(move || {
                    for i in 0..2 * BLOCKS as u64 {
                        let vaddr = i * BLOCK as u64;
                        sink.run(run(dst, vaddr, (BLOCK / page) as u64, PE_PRESENT), &mut &full[..]).unwrap();
                    }
                    sink.finish().unwrap();
                });
                let receiver = std::thread::spawn(move || {
                    let mut blocks = 0;
                    source
                        .each(|r| {
                            let Received::Block(b) = r else { return Ok(()) };
                            assert_eq!(b.bytes().len(), BLOCK);
                            blocks += 1;
                            std::thread::sleep(Duration::from_millis(1));
                            Ok::<_, ()>(())
                        })
                        .map(|()| blocks)
                });
                (sender, receiver)
            })
            .collect();
        for (sender, receiver) in streams {
            sender.join().unwrap();
            assert_eq!(receiver.join().unwrap(), Ok(2 * BLOCKS));
        }
        let free = pool.inner.free.lock().unwrap();
        assert!(free.made <= BLOCKS, "{} buffers made", free.made);
        assert_eq!(free.buffers.len(), free.made, "every buffer came back");
    }
}
