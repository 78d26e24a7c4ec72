//! Following what a restored process's userfaultfd says: faults (the chunk around the page
//! asked for first, and the next ones after it), forks (the child served too, and handed to
//! the guard) and mapping changes (followed in the pages still to fill).

use std::os::fd::AsFd;
use std::time::Instant;

use tracing::{debug, info};

use super::server::{Fault, FaultServer, FaultServerError, Task};
use crate::engine::host::FaultEvent;
use crate::engine::lock;
use crate::linux::uffd::Event;
use crate::pages::PAGE_SIZE as PAGE;
use crate::store::{Ask, CHUNK};

impl FaultServer {
    /// Reads and follows the events of task `t`; returns how many there were. Forked
    /// children are taken on first, so that an error in the others never drops one of their
    /// userfaultfds before the tree is killed.
    pub(super) fn read_events(&mut self, t: usize) -> Result<usize, FaultServerError> {
        let mut events = Vec::new();
        let task = &self.tasks[t];
        if task.gone {
            return Ok(0);
        }
        let read = match &self.direct {
            Some(direct) if task.direct => {
                direct.read_events(task.pid as u64, task.uffd.as_ref(), &mut events)
            }
            _ => task.uffd.read_events(&mut events).map(|()| false),
        };
        let pid = task.pid;
        self.tasks[t].direct = read.map_err(|source| FaultServerError::Events { pid, source })?;
        let count = events.len();
        let (forks, others): (Vec<FaultEvent>, Vec<FaultEvent>) =
            events.into_iter().partition(|e| matches!(e, Event::Fork { .. }));
        for fork in forks {
            let Event::Fork { child } = fork else { continue };
            let copy = child.as_fd().try_clone_to_owned().map_err(FaultServerError::Poll)?;
            self.control.guard_also(copy.try_clone().map_err(FaultServerError::Poll)?);
            lock(&self.control.uffds).push(copy);
            let pid = self.tasks[t].pid;
            info!(pid, "a restored process forked while its memory was arriving");
            let pages = self.tasks[t].pages.forked();
            self.add_task(Task::new(pid, child, pages));
        }
        for event in others {
            let Task { pid, pages, read_ahead, .. } = &mut self.tasks[t];
            match event {
                Event::PageFault { address } => {
                    let page = address & !(PAGE - 1);
                    if let Some((addr, i)) = pages.fault(page) {
                        self.chunks.get(i, Ask::Urgent).map_err(FaultServerError::Fetch)?;
                        let (window, asked_through) = read_ahead.window_for(addr, CHUNK as u64);
                        let ahead: Vec<(u64, usize)> = pages.chunks_from(addr + 1).take(window).collect();
                        read_ahead.asked(
                            addr,
                            ahead.last().map_or(asked_through, |&(at, _)| at.max(asked_through)),
                        );
                        // On a walk, the chunks the fault before asked for are on their way.
                        let mut next: Vec<(u64, usize)> =
                            ahead.into_iter().filter(|&(at, _)| at > asked_through).collect();
                        let strides = read_ahead.strides_ahead(addr, CHUNK as u64);
                        if let Some(first) = strides.first() {
                            debug!(pid = *pid, fault = addr, next = first.start, "a strided read");
                        }
                        for block in strides {
                            next.extend(pages.chunks_from(block.start).take_while(|&(at, _)| at < block.end));
                        }
                        for &(_, j) in &next {
                            self.chunks.get(j, Ask::Soon).map_err(FaultServerError::Fetch)?;
                        }
                        self.tasks[t].ahead.extend(next);
                    }
                    self.faults.push(Fault { task: t, page, since: Instant::now() });
                }
                Event::Fork { .. } => {}
                Event::Remap { from, to, len } => {
                    pages.remapped(from, to, len);
                    self.retry_faults_in(t, from, from + len);
                    self.retry_faults_in(t, to, to + len);
                }
                Event::Remove { start, end } => {
                    pages.removed(start, end);
                    self.retry_faults_in(t, start, end);
                }
                Event::Unmap { start, end } => {
                    pages.unmapped(start, end);
                    self.retry_faults_in(t, start, end);
                }
            }
            self.settle(t);
        }
        Ok(count)
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
}
