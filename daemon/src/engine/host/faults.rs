//! What the fault server asks of the kernel (see `engine/hot_restore/`): the userfaultfds CRIU
//! hands over for the restored processes, read for their events and filled.
//! [`super::LinuxHost`] takes them as userfaultfds (`linux/uffd.rs`).

use std::io;
use std::os::fd::{AsFd, OwnedFd};

use crate::linux::uffd::Event;
use crate::linux::uffd::FillError;

/// The kernel's userfaultfds, for lazily restored memory.
pub trait Userfaults: Send + Sync {
    /// Takes over `fd`, a restored process's userfaultfd that CRIU handed over.
    fn adopt_userfaultfd(&self, fd: OwnedFd) -> io::Result<Box<dyn FaultFd>>;
}

/// What a userfaultfd says: a forked child's comes adopted.
pub type FaultEvent = Event<Box<dyn FaultFd>>;

/// One process's userfaultfd; it polls readable when events wait.
pub trait FaultFd: AsFd + Send + Sync {
    /// The events waiting, appended to `out`; none (not an error) when nothing waits.
    fn read_events(&self, out: &mut Vec<FaultEvent>) -> io::Result<()>;
    /// Registers `[start, start + len)` of the process for missing-page faults.
    fn register(&self, start: u64, len: u64) -> io::Result<()>;
    /// Copies `src` to `dst` in the process and wakes what waits on those pages.
    fn copy(&self, dst: u64, src: &[u8]) -> Result<(), FillError>;
    /// Maps zero pages over `[dst, dst + len)` in the process and wakes what waits.
    fn zero(&self, dst: u64, len: u64) -> Result<(), FillError>;
    /// Wakes the threads waiting on `[start, start + len)` (pages that are there already).
    fn wake(&self, start: u64, len: u64) -> io::Result<()>;
}
