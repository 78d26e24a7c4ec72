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
use std::os::fd::AsFd;
use std::sync::Arc;
use std::sync::atomic::Ordering;
use std::time::{Duration, Instant};

use nix::poll::{PollFd, PollFlags, PollTimeout, poll};
use tracing::debug;

use super::control::Control;
use super::direct::Direct;
use super::pages::Pages;
use super::read_ahead::ReadAhead;
use crate::criu::lazy_socket::{Announcement, LazyListener, LazySocketError, RestoreConnection};
use crate::engine::host::{FaultFd, Host};
use crate::engine::lock;
use crate::pages::PAGE_SIZE as PAGE;
use crate::store::{Ask, ChunkReader, LazyFetchError};

/// Longest wait in poll: deadlines are checked this often.
const IDLE_WAIT: Duration = Duration::from_millis(250);
/// Wait in poll while a copy waits for a mapping change's event.
const CHANGING_WAIT: Duration = Duration::from_millis(1);

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
    #[error("the fault server stopped unexpectedly (a bug in stasisd)")]
    Panicked,
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

/// One restored process (or a child it forked since).
pub(super) struct Task {
    /// Its pid in the checkpoint: where its memory is in the store.
    pub pid: i32,
    pub uffd: Arc<dyn FaultFd>,
    pub pages: Pages,
    /// The decoding threads put its memory in place too (see direct.rs).
    pub direct: bool,
    /// It exited: nothing more to put in place.
    pub gone: bool,
    /// Chunks asked for after a fault, put in place as soon as they arrive: image address,
    /// index.
    pub ahead: VecDeque<(u64, usize)>,
    /// How many chunks to ask for after its next fault.
    pub read_ahead: ReadAhead,
}

impl Task {
    pub(super) fn new(pid: i32, uffd: Box<dyn FaultFd>, pages: Pages) -> Task {
        let uffd = Arc::from(uffd);
        let read_ahead = ReadAhead::default();
        Task { pid, uffd, pages, direct: false, gone: false, ahead: VecDeque::new(), read_ahead }
    }
}

/// A fault not answered yet: what the page holds is decided when it is answered, since the
/// process's memory may have changed meanwhile.
pub(super) struct Fault {
    pub task: usize,
    /// The page, where the process sees it.
    pub page: u64,
    pub since: Instant,
}

/// The server, until its thread runs it.
pub(super) struct FaultServer {
    /// Where the userfaultfds CRIU hands over are taken as such.
    host: Arc<dyn Host>,
    listener: Option<LazyListener>,
    conn: Option<RestoreConnection>,
    processes: usize,
    pub(super) finished: bool,
    pub(super) tasks: Vec<Task>,
    pub(super) faults: Vec<Fault>,
    pub(super) chunks: ChunkReader,
    /// How many tasks still lack part of each chunk: released from the cache at 0.
    pub(super) needs: Vec<u16>,
    timeout: Duration,
    pub(super) control: Arc<Control>,
    /// Chunks that arrived and are not in place yet.
    pub(super) arrived: VecDeque<usize>,
    /// Where the look for chunks the prefetcher does not bring is: task, image address.
    pub(super) cursor: (usize, u64),
    /// A copy waits for a mapping change whose event has not come yet.
    pub(super) changing: bool,
    pub(super) stats: ServeStats,
    /// Where the decoding threads put chunks in place themselves (an eager restore).
    pub(super) direct: Option<Arc<Direct>>,
}

impl FaultServer {
    /// A server for a restore whose work directory `listener` listens in, restoring
    /// `processes` processes whose lazy memory `chunks` serves, on `host`; with `direct`, the
    /// decoding threads put chunks in place too.
    pub fn new(
        host: Arc<dyn Host>,
        listener: LazyListener,
        processes: usize,
        chunks: ChunkReader,
        timeout: Duration,
        control: Arc<Control>,
        direct: Option<Arc<Direct>>,
    ) -> FaultServer {
        let needs = vec![0; chunks.memory().len()];
        FaultServer {
            host,
            listener: Some(listener),
            conn: None,
            processes,
            finished: false,
            tasks: Vec::new(),
            faults: Vec::new(),
            chunks,
            needs,
            timeout,
            control,
            arrived: VecDeque::new(),
            cursor: (0, 0),
            changing: false,
            stats: ServeStats::default(),
            direct,
        }
    }

    /// Serves until every page is in place, then answers faults until closed (see
    /// [`Control::stop`]); returns the session's totals. On failure `on_failure` runs while the
    /// userfaultfds are still open (to kill the tree before they close). The outcome is in
    /// the control's phase too.
    pub fn run(mut self, on_failure: impl FnOnce(&FaultServerError)) -> Result<ServeStats, FaultServerError> {
        let control = self.control.clone();
        // A panic fails the session like any error: the tree is killed while the
        // userfaultfds are still open, and nobody waits for the outcome forever.
        let served = std::panic::catch_unwind(std::panic::AssertUnwindSafe(|| {
            self.serve().and_then(|()| {
                // Nothing more to put in place before the tree runs.
                self.close_direct();
                control.update(|p| p.outcome = Some((Ok(()), Instant::now())));
                self.linger()
            })
        }))
        .unwrap_or_else(|_| Err(FaultServerError::Panicked));
        self.close_direct();
        if let Err(e) = &served {
            on_failure(e);
            control.update(|p| p.outcome = Some((Err(crate::error_chain(e)), Instant::now())));
        }
        self.stats.processes = self.tasks.len();
        let stats = self.stats;
        drop(self);
        control.forget_uffds();
        control.update(|p| p.closed = true);
        served.map(|()| stats)
    }

    /// No more copies by the decoding threads (see direct.rs).
    fn close_direct(&self) {
        if let Some(direct) = &self.direct {
            direct.close();
        }
    }

    /// Answers faults of a resident tree (memory it dropped since reads zeros) until closed.
    fn linger(&mut self) -> Result<(), FaultServerError> {
        while !self.control.stopped.load(Ordering::SeqCst) {
            self.read_all_events()?;
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
        self.placed_directly();
        self.read_all_events()?;
        self.answer_faults()?;
        // While faults that follow a walk or a stride wait, what they asked for ahead comes
        // next and nothing else is put in place; other faults (random ones) do not hold the
        // rest back.
        let following = self.faults.iter().any(|f| self.tasks[f.task].read_ahead.following());
        if self.finished && !following { self.background() } else { Ok(false) }
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
                    let uffd = self.host.adopt_userfaultfd(uffd).map_err(FaultServerError::Poll)?;
                    let pages = Pages::new(self.chunks.memory(), pid as u64);
                    debug!(pid, bytes = pages.bytes_left(), "userfaultfd of a restored process");
                    let mut task = Task::new(pid, uffd, pages);
                    if let Some(direct) = &self.direct
                        && !self.tasks.iter().any(|t| t.pid == pid)
                    {
                        direct.add(pid as u64, task.uffd.clone());
                        task.direct = true;
                    }
                    self.add_task(task);
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

    /// Starts serving `task`: the chunks it lacks are needed once more.
    pub(super) fn add_task(&mut self, task: Task) {
        for i in task.pages.chunk_indices() {
            self.needs[i] += 1;
        }
        self.tasks.push(task);
    }

    pub(super) fn read_all_events(&mut self) -> Result<(), FaultServerError> {
        for task in 0..self.tasks.len() {
            self.read_events(task)?;
        }
        Ok(())
    }

    /// Answers the faults whose pages can be put in place now; fails those that waited too
    /// long. What a page gets is decided now: its chunk, if it still lacks it, else zeros
    /// (memory the checkpoint has nothing for, or dropped since) or nothing (already there).
    fn answer_faults(&mut self) -> Result<(), FaultServerError> {
        let mut i = 0;
        while i < self.faults.len() {
            let Fault { task: t, page, since } = self.faults[i];
            if self.tasks[t].gone {
                self.faults.swap_remove(i);
                continue;
            }
            let answered = match self.tasks[t].pages.fault(page) {
                Some((addr, index)) => {
                    match self.chunks.get(index, Ask::Urgent).map_err(FaultServerError::Fetch)? {
                        Some(data) => self.put_chunk(t, addr, &data)?,
                        None => {
                            self.check_deadline(since)?;
                            false
                        }
                    }
                }
                None => self.put_zero_page(t, page)?,
            };
            if !answered {
                i += 1;
                continue;
            }
            self.faults.swap_remove(i);
            // The page may have been there already (placed for another fault, say).
            let _ = self.tasks[t].uffd.wake(page, PAGE);
            self.stats.faults += 1;
            self.stats.max_fault_wait = self.stats.max_fault_wait.max(since.elapsed());
        }
        Ok(())
    }

    /// Fails the session if a fault has waited longer than the timeout.
    fn check_deadline(&self, since: Instant) -> Result<(), FaultServerError> {
        if since.elapsed() <= self.timeout {
            return Ok(());
        }
        let error = LazyFetchError::Timeout {
            id: self.chunks.memory().id().to_owned(),
            secs: self.timeout.as_secs(),
        };
        self.chunks.fail(error.clone());
        Err(FaultServerError::Fetch(error))
    }

    /// Waits for CRIU, a fault, an arrived chunk or a stop (at most [`IDLE_WAIT`], or a
    /// moment while a copy waits for a mapping change).
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
        let wait = if std::mem::take(&mut self.changing) { CHANGING_WAIT } else { IDLE_WAIT };
        match poll(&mut fds, PollTimeout::try_from(wait).unwrap_or(PollTimeout::MAX)) {
            Ok(_) | Err(nix::errno::Errno::EINTR) => {}
            Err(e) => return Err(FaultServerError::Poll(e.into())),
        }
        drop(fds);
        self.chunks.drain();
        let _ = self.control.wake.read();
        Ok(())
    }
}
