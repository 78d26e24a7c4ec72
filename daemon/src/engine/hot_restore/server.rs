//! stasisd's own lazy-pages daemon: it takes the restored processes' userfaultfds from CRIU's
//! restore and puts their memory in place itself, chunk by chunk, straight from the store's
//! verified chunks (no page is written to the images directory, or passed through CRIU).
//!
//! ```text
//! one blocking thread, one poll loop:
//!   lazy-pages.socket  -> each process's userfaultfd, then "restore finished"
//!   userfaultfds       -> a fault: the whole chunk around the page, ahead of anything else,
//!                         and the next chunks asked for (a job reads its memory in runs)
//!                      -> fork, mremap, munmap, madvise: followed (pages.rs)
//!   chunks arriving    -> once the restore finished: everything else, in address order
//!   all in place       -> resident: faults are still answered (with zeros: memory the
//!                         process dropped since) until the owner closes the server, after
//!                         the guard let its copies go; then the userfaultfds close
//! ```
//! A page the tree touches waits until it is in place; a page that cannot be put in place
//! (the store fails, a chunk is corrupted, a page is not where CRIU registered it) fails the
//! session, and the session's owner kills the tree before the userfaultfds close.

use std::collections::VecDeque;
use std::os::fd::{AsFd, OwnedFd};
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::{Arc, Condvar, Mutex};
use std::time::{Duration, Instant};

use nix::poll::{PollFd, PollFlags, PollTimeout, poll};
use nix::sys::eventfd::{EfdFlags, EventFd};
use tracing::debug;

use super::pages::{Pages, Piece};
use crate::criu::lazy_socket::{Announcement, LazyListener, LazySocketError, RestoreConnection};
use crate::criu::pageserver::PAGE_SIZE as PAGE;
use crate::engine::lock;
use crate::linux::uffd::{Event, FillError, Userfaultfd};
use crate::store::{ChunkData, ChunkReader, LazyFetchError};

/// Chunks after a faulted one that are asked for at once.
const READ_AHEAD: usize = 15;
/// Bytes put in place in the background between two looks for faults.
const BACKGROUND_BUDGET: u64 = 512 << 10;
/// Longest wait in poll: deadlines are checked this often.
const IDLE_WAIT: Duration = Duration::from_millis(250);

/// Putting lazy memory in place failed.
#[derive(Debug, thiserror::Error)]
pub enum FaultServerError {
    #[error("CRIU's restore broke the lazy-pages protocol")]
    Protocol(#[source] LazySocketError),
    #[error("waiting for CRIU's restore or the tree's faults failed")]
    Poll(#[source] std::io::Error),
    #[error(transparent)]
    Fetch(LazyFetchError),
    #[error("reading the userfaultfd of restored pid {pid} failed")]
    Events {
        pid: i32,
        #[source]
        source: std::io::Error,
    },
    #[error("putting memory at {address:#x} of restored pid {pid} in place failed ({errno})")]
    Fill { pid: i32, address: u64, errno: nix::errno::Errno },
    #[error(
        "memory of restored pid {pid} at {address:#x} is not where CRIU registered it for a lazy restore"
    )]
    Unregistered { pid: i32, address: u64 },
    #[error("the lazy restore was stopped")]
    Stopped,
}

/// Totals of one session.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct ServeStats {
    pub faults: u64,
    /// Longest time a fault waited for its chunk.
    pub max_fault_wait: Duration,
    pub bytes_placed: u64,
    pub processes: usize,
}

/// What the session's owner sees of the server while it runs, and how it closes it.
pub(in crate::engine) struct Control {
    stopped: AtomicBool,
    /// Wakes the server's poll (to stop or close).
    wake: EventFd,
    placed: AtomicU64,
    /// Copies of the tree's userfaultfds, for the guard.
    uffds: Mutex<Vec<OwnedFd>>,
    state: Mutex<Phase>,
    changed: Condvar,
}

/// Where a session is.
#[derive(Debug, Clone, Default)]
struct Phase {
    /// CRIU said the restore finished: every userfaultfd is in `uffds`.
    finished: bool,
    /// Every page in place, or why not, and when.
    outcome: Option<(Result<(), String>, Instant)>,
    /// The server let go of its userfaultfds.
    closed: bool,
}

impl Control {
    pub fn new() -> std::io::Result<Control> {
        Ok(Control {
            stopped: AtomicBool::new(false),
            wake: EventFd::from_value_and_flags(0, EfdFlags::EFD_CLOEXEC | EfdFlags::EFD_NONBLOCK)?,
            placed: AtomicU64::new(0),
            uffds: Mutex::new(Vec::new()),
            state: Mutex::new(Phase::default()),
            changed: Condvar::new(),
        })
    }

    /// Stops the server: before every page is in place that is a failure
    /// ([`FaultServerError::Stopped`]), after it the server closes.
    pub fn stop(&self) {
        self.stopped.store(true, Ordering::SeqCst);
        let _ = self.wake.write(1);
    }

    /// Bytes of memory put in place so far.
    pub fn placed(&self) -> u64 {
        self.placed.load(Ordering::Relaxed)
    }

    /// Copies of every userfaultfd CRIU handed over, once it said the restore finished
    /// (waiting at most `wait` for that); `None` if it did not.
    pub fn uffd_copies(&self, wait: Duration) -> std::io::Result<Option<Vec<OwnedFd>>> {
        let finished =
            self.wait_for(Some(wait), |p| p.finished || p.outcome.is_some()).is_some_and(|p| p.finished);
        if !finished {
            return Ok(None);
        }
        lock(&self.uffds).iter().map(OwnedFd::try_clone).collect::<Result<_, _>>().map(Some)
    }

    /// How the session ended if it did (every page in place, or why not), and when.
    pub fn outcome(&self) -> Option<(Result<(), String>, Instant)> {
        lock(&self.state).outcome.clone()
    }

    /// Waits until every page is in place; the reason when the session failed instead.
    pub fn wait_resident(&self) -> Result<(), String> {
        let phase = self.wait_for(None, |p| p.outcome.is_some());
        phase.and_then(|p| p.outcome).map_or_else(|| Err("the session ended".into()), |(o, _)| o)
    }

    /// Closes the server of a resident tree and waits until its userfaultfds are closed.
    pub fn close(&self) {
        self.stop();
        self.wait_for(None, |p| p.closed);
    }

    /// The phase once `done` holds of it, waiting at most `wait` (`None` when it did not).
    fn wait_for(&self, wait: Option<Duration>, done: impl Fn(&Phase) -> bool) -> Option<Phase> {
        let deadline = wait.map(|w| Instant::now() + w);
        let mut state = lock(&self.state);
        while !done(&state) {
            state = match deadline {
                None => self.changed.wait(state).unwrap_or_else(|p| p.into_inner()),
                Some(deadline) => {
                    let left = deadline.saturating_duration_since(Instant::now());
                    if left.is_zero() {
                        return None;
                    }
                    self.changed.wait_timeout(state, left).unwrap_or_else(|p| p.into_inner()).0
                }
            };
        }
        Some(state.clone())
    }

    fn update(&self, change: impl FnOnce(&mut Phase)) {
        change(&mut lock(&self.state));
        self.changed.notify_all();
    }
}

/// One restored process (or a child it forked since).
struct Task {
    /// Its pid in the checkpoint: where its memory is in the store.
    pid: i32,
    uffd: Userfaultfd,
    pages: Pages,
    /// It exited: nothing more to put in place.
    gone: bool,
    /// Chunks asked for after a fault, put in place as soon as they arrive: image address,
    /// index.
    ahead: VecDeque<(u64, usize)>,
}

/// A fault not answered yet.
struct Fault {
    task: usize,
    /// The page, where the process sees it.
    page: u64,
    /// The chunk to put in place (image address, index); `None` for a page the checkpoint
    /// has nothing for (it reads zeros).
    chunk: Option<(u64, usize)>,
    since: Instant,
}

/// How putting one piece in place went.
enum Placed {
    All,
    /// The process's mappings are changing: its events must be read first. The first bytes
    /// are in place.
    Interrupted(u64),
    /// The page at this offset is in no registered mapping.
    NoMapping(u64),
    /// The process exited.
    Gone,
}

/// The server, until its thread runs it.
pub(super) struct FaultServer {
    listener: Option<LazyListener>,
    conn: Option<RestoreConnection>,
    processes: usize,
    finished: bool,
    tasks: Vec<Task>,
    faults: Vec<Fault>,
    chunks: ChunkReader,
    timeout: Duration,
    control: Arc<Control>,
    /// Chunks that arrived and are not in place yet.
    arrived: VecDeque<usize>,
    /// Where the look for chunks the prefetcher does not bring is: task, image address.
    cursor: (usize, u64),
    stats: ServeStats,
}

impl FaultServer {
    /// A server for a restore whose work directory `listener` listens in, restoring
    /// `processes` processes whose lazy memory `chunks` serves.
    pub fn new(
        listener: LazyListener,
        processes: usize,
        chunks: ChunkReader,
        timeout: Duration,
        control: Arc<Control>,
    ) -> FaultServer {
        FaultServer {
            listener: Some(listener),
            conn: None,
            processes,
            finished: false,
            tasks: Vec::new(),
            faults: Vec::new(),
            chunks,
            timeout,
            control,
            arrived: VecDeque::new(),
            cursor: (0, 0),
            stats: ServeStats::default(),
        }
    }

    /// Serves until every page is in place, then answers faults until closed (see
    /// [`Control::stop`]); returns the session's totals. On failure `on_failure` runs while the
    /// userfaultfds are still open (to kill the tree before they close). The outcome is in
    /// the control's phase too.
    pub fn run(mut self, on_failure: impl FnOnce(&FaultServerError)) -> Result<ServeStats, FaultServerError> {
        let control = self.control.clone();
        let served = self.serve().and_then(|()| {
            control.update(|p| p.outcome = Some((Ok(()), Instant::now())));
            self.linger()
        });
        if let Err(e) = &served {
            on_failure(e);
            control.update(|p| p.outcome = Some((Err(crate::error_chain(e)), Instant::now())));
        }
        self.stats.processes = self.tasks.len();
        let stats = self.stats;
        drop(self);
        control.update(|p| p.closed = true);
        served.map(|()| stats)
    }

    /// Answers faults of a resident tree (memory it dropped since reads zeros) until closed.
    fn linger(&mut self) -> Result<(), FaultServerError> {
        while !self.control.stopped.load(Ordering::SeqCst) {
            for task in 0..self.tasks.len() {
                self.read_events(task)?;
            }
            self.answer_faults()?;
            self.wait()?;
        }
        Ok(())
    }

    fn serve(&mut self) -> Result<(), FaultServerError> {
        loop {
            if self.control.stopped.load(Ordering::SeqCst) {
                return Err(FaultServerError::Stopped);
            }
            if let Some(e) = self.chunks.failure() {
                return Err(FaultServerError::Fetch(e));
            }
            let busy = self.step()?;
            if self.finished
                && self.faults.is_empty()
                && self.tasks.iter().all(|t| t.gone || t.pages.is_done())
            {
                return Ok(());
            }
            if !busy {
                self.wait()?;
            }
        }
    }

    /// Does what can be done now; whether there may be more right away.
    fn step(&mut self) -> Result<bool, FaultServerError> {
        self.talk_to_restore()?;
        for task in 0..self.tasks.len() {
            self.read_events(task)?;
        }
        self.answer_faults()?;
        if self.finished && self.faults.is_empty() { self.background() } else { Ok(false) }
    }

    /// Takes CRIU's connection and what it announced.
    fn talk_to_restore(&mut self) -> Result<(), FaultServerError> {
        if let Some(listener) = &self.listener
            && let Some(conn) = listener.accept(self.processes).map_err(FaultServerError::Poll)?
        {
            self.conn = Some(conn);
            self.listener = None;
        }
        let Some(conn) = &mut self.conn else { return Ok(()) };
        for said in conn.read().map_err(FaultServerError::Protocol)? {
            match said {
                Announcement::Task { pid, uffd } => {
                    let copy = uffd.try_clone().map_err(FaultServerError::Poll)?;
                    lock(&self.control.uffds).push(copy);
                    let pages = Pages::new(self.chunks.memory(), pid as u64);
                    debug!(pid, bytes = pages.bytes_left(), "userfaultfd of a restored process");
                    let uffd = Userfaultfd::from_fd(uffd);
                    self.tasks.push(Task { pid, uffd, pages, gone: false, ahead: VecDeque::new() });
                }
                Announcement::Zombie { pid } => debug!(pid, "a zombie of the restored tree"),
                Announcement::Finished => self.finished = true,
            }
        }
        if self.finished && self.conn.is_some() {
            // CRIU says nothing more.
            self.conn = None;
            self.chunks.start_prefetch();
            self.control.update(|p| p.finished = true);
        }
        Ok(())
    }

    /// Reads and follows the events of task `t`.
    fn read_events(&mut self, t: usize) -> Result<(), FaultServerError> {
        let mut events = Vec::new();
        let task = &self.tasks[t];
        task.uffd
            .read_events(&mut events)
            .map_err(|source| FaultServerError::Events { pid: task.pid, source })?;
        for event in events {
            let task = &mut self.tasks[t];
            match event {
                Event::PageFault { address } => {
                    let page = address & !(PAGE - 1);
                    let chunk = task.pages.fault(page);
                    if let Some((addr, i)) = chunk {
                        self.chunks.get(i, true).map_err(FaultServerError::Fetch)?;
                        for (next, j) in task.pages.chunks_from(addr + 1).take(READ_AHEAD) {
                            self.chunks.get(j, false).map_err(FaultServerError::Fetch)?;
                            task.ahead.push_back((next, j));
                        }
                    }
                    self.faults.push(Fault { task: t, page, chunk, since: Instant::now() });
                }
                Event::Fork { child } => {
                    let pages = task.pages.clone();
                    let copy = child.as_fd().try_clone_to_owned().map_err(FaultServerError::Poll)?;
                    lock(&self.control.uffds).push(copy);
                    let pid = task.pid;
                    debug!(pid, "a restored process forked");
                    self.tasks.push(Task { pid, uffd: child, pages, gone: false, ahead: VecDeque::new() });
                }
                Event::Remap { from, to, len } => {
                    task.pages.remapped(from, to, len);
                    self.retry_faults_in(t, from, from + len);
                }
                Event::Remove { start, end } => {
                    task.pages.removed(start, end);
                    self.retry_faults_in(t, start, end);
                }
                Event::Unmap { start, end } => {
                    task.pages.unmapped(start, end);
                    self.retry_faults_in(t, start, end);
                }
            }
        }
        Ok(())
    }

    /// Faults of task `t` in `[start, end)`, whose memory just changed: their threads are
    /// woken to fault again where the memory is now.
    fn retry_faults_in(&mut self, t: usize, start: u64, end: u64) {
        let uffd = &self.tasks[t].uffd;
        self.faults.retain(|f| {
            let hit = f.task == t && (start..end).contains(&f.page);
            if hit {
                let _ = uffd.wake(f.page, PAGE);
            }
            !hit
        });
    }

    /// Answers the faults whose chunks are here; fails those that waited too long.
    fn answer_faults(&mut self) -> Result<(), FaultServerError> {
        let mut i = 0;
        while i < self.faults.len() {
            let Fault { task: t, page, chunk, since } = self.faults[i];
            let data = match chunk {
                None => Some(ChunkData::Zero),
                Some((_, index)) => self.chunks.get(index, true).map_err(FaultServerError::Fetch)?,
            };
            let Some(data) = data else {
                if since.elapsed() > self.timeout {
                    let error = LazyFetchError::Timeout {
                        id: self.chunks.memory().id().to_owned(),
                        secs: self.timeout.as_secs(),
                    };
                    self.chunks.fail(error.clone());
                    return Err(FaultServerError::Fetch(error));
                }
                i += 1;
                continue;
            };
            self.faults.swap_remove(i);
            match chunk {
                Some((addr, index)) => self.put_chunk(t, addr, index, &data)?,
                None => {
                    let piece = Piece { offset: 0, len: PAGE, address: page };
                    if let Placed::Interrupted(_) = self.place(t, piece, &data)? {
                        self.read_events(t)?;
                        self.faults.push(Fault { task: t, page, chunk, since });
                        continue;
                    }
                }
            }
            // The page may have been there already (placed for another fault, say).
            let _ = self.tasks[t].uffd.wake(page, PAGE);
            self.stats.faults += 1;
            self.stats.max_fault_wait = self.stats.max_fault_wait.max(since.elapsed());
        }
        Ok(())
    }

    /// Puts in place what task `t` still lacks of the chunk at image address `addr` (index
    /// `index`); releases the chunk once no task needs it.
    fn put_chunk(
        &mut self,
        t: usize,
        addr: u64,
        index: usize,
        data: &ChunkData,
    ) -> Result<(), FaultServerError> {
        let mut unmapped = None;
        'again: loop {
            for piece in self.tasks[t].pages.pieces(addr) {
                match self.place(t, piece, data)? {
                    Placed::All => self.filled(t, addr, piece.offset, piece.len),
                    Placed::Interrupted(done) => {
                        self.filled(t, addr, piece.offset, done);
                        self.read_events(t)?;
                        continue 'again;
                    }
                    Placed::NoMapping(done) => {
                        self.filled(t, addr, piece.offset, done);
                        let address = piece.address + done;
                        // An unmap whose event is not read yet; twice is a page CRIU never
                        // registered, which would read zeros.
                        if unmapped == Some(address) {
                            return Err(FaultServerError::Unregistered { pid: self.tasks[t].pid, address });
                        }
                        unmapped = Some(address);
                        self.read_events(t)?;
                        continue 'again;
                    }
                    Placed::Gone => {
                        let task = &mut self.tasks[t];
                        debug!(pid = task.pid, "a restored process exited before its memory was in");
                        task.gone = true;
                        task.pages = Pages::empty();
                        break 'again;
                    }
                }
            }
            break;
        }
        if self.tasks.iter().all(|task| task.pages.pieces(addr).is_empty()) {
            self.chunks.release(index);
        }
        Ok(())
    }

    fn filled(&mut self, t: usize, addr: u64, offset: u64, len: u64) {
        if len > 0 {
            self.tasks[t].pages.filled(addr, offset, len);
            self.stats.bytes_placed += len;
            self.control.placed.fetch_add(len, Ordering::Relaxed);
        }
    }

    /// Copies (or zeroes) one piece into task `t`. A span that crosses mappings is cut in
    /// halves until each piece lies in one.
    fn place(&self, t: usize, piece: Piece, data: &ChunkData) -> Result<Placed, FaultServerError> {
        let task = &self.tasks[t];
        let (mut at, mut span) = (0u64, piece.len);
        while at < piece.len {
            let len = span.min(piece.len - at);
            let dst = piece.address + at;
            let result = match data {
                ChunkData::Zero => task.uffd.zero(dst, len),
                ChunkData::Bytes(bytes) => {
                    let from = (piece.offset + at) as usize;
                    task.uffd.copy(dst, &bytes[from..from + len as usize])
                }
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

    /// Puts arrived chunks in place: those asked for after a fault first, then the others as
    /// they arrived (the prefetcher's order), then what is left in address order; whether
    /// it stopped for its budget (more is ready).
    fn background(&mut self) -> Result<bool, FaultServerError> {
        let mut budget = BACKGROUND_BUDGET;
        while budget > 0 {
            let Some((t, addr, index, data)) = self.next_ready()? else { return Ok(false) };
            let before = self.stats.bytes_placed;
            self.put_chunk(t, addr, index, &data)?;
            budget = budget.saturating_sub((self.stats.bytes_placed - before).max(PAGE));
        }
        Ok(true)
    }

    /// The next chunk to put in place that is here: task, image address, index, bytes.
    fn next_ready(&mut self) -> Result<Option<(usize, u64, usize, ChunkData)>, FaultServerError> {
        for t in 0..self.tasks.len() {
            while let Some(&(addr, index)) = self.tasks[t].ahead.front() {
                if self.tasks[t].pages.pieces(addr).is_empty() {
                    self.tasks[t].ahead.pop_front();
                    continue;
                }
                match self.chunks.peek(index) {
                    Some(data) => {
                        self.tasks[t].ahead.pop_front();
                        return Ok(Some((t, addr, index, data)));
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
            match (needing, self.chunks.peek(index)) {
                (Some(t), Some(data)) => return Ok(Some((t, addr, index, data))),
                // Put in place already (for a fault), or released meanwhile.
                (None, _) => self.chunks.release(index),
                (Some(_), None) => {}
            }
        }
        self.left_over()
    }

    /// The first chunk still to fill, in task and address order, if it is here; asked for
    /// otherwise. (Chunks the prefetcher never brings: zero ones, and those a forked child
    /// needs after its parent's were released.)
    fn left_over(&mut self) -> Result<Option<(usize, u64, usize, ChunkData)>, FaultServerError> {
        while self.cursor.0 < self.tasks.len() {
            let (t, from) = self.cursor;
            let Some((addr, index)) = self.tasks[t].pages.chunks_from(from).next() else {
                self.cursor = (t + 1, 0);
                continue;
            };
            self.cursor.1 = addr;
            return Ok(self
                .chunks
                .get(index, false)
                .map_err(FaultServerError::Fetch)?
                .map(|d| (t, addr, index, d)));
        }
        // A child forked after the cursor passed: start over.
        if self.tasks.iter().any(|t| !t.gone && !t.pages.is_done()) {
            self.cursor = (0, 0);
        }
        Ok(None)
    }

    /// Waits for CRIU, a fault, an arrived chunk or a stop (at most [`IDLE_WAIT`]).
    fn wait(&mut self) -> Result<(), FaultServerError> {
        let readable = PollFlags::POLLIN;
        let mut fds = vec![
            PollFd::new(self.chunks.waker(), readable),
            PollFd::new(self.control.wake.as_fd(), readable),
        ];
        if let Some(listener) = &self.listener {
            fds.push(PollFd::new(listener.as_fd(), readable));
        }
        if let Some(conn) = &self.conn {
            fds.push(PollFd::new(conn.as_fd(), readable));
        }
        fds.extend(self.tasks.iter().filter(|t| !t.gone).map(|t| PollFd::new(t.uffd.as_fd(), readable)));
        let timeout = PollTimeout::try_from(IDLE_WAIT).unwrap_or(PollTimeout::MAX);
        match poll(&mut fds, timeout) {
            Ok(_) | Err(nix::errno::Errno::EINTR) => {}
            Err(e) => return Err(FaultServerError::Poll(e.into())),
        }
        drop(fds);
        self.chunks.drain();
        let _ = self.control.wake.read();
        Ok(())
    }
}
