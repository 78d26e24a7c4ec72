//! The fake's userfaultfds: each reports the faults the test sets, and records what the fault
//! server puts in place through it (or fails its copies); and a stand-in for the lazy-restore
//! guard, which the fault server's sessions start.

use std::io;
use std::os::fd::{AsFd, BorrowedFd, OwnedFd};
use std::os::unix::fs::PermissionsExt;
use std::path::Path;
use std::sync::{Arc, Mutex};

use nix::errno::Errno;

use super::fake::FakeHost;
use super::{FaultEvent, FaultFd, Userfaults};
use crate::linux::uffd::Event;
use crate::linux::uffd::FillError;

/// What the fake's userfaultfds say, and what was done through them.
#[derive(Debug, Default)]
pub struct FakeFaults {
    /// The addresses at which each userfaultfd taken over reports a fault, on its first read.
    pub at: Mutex<Vec<u64>>,
    /// What was put in place, in order: the address and the bytes (`None`: a zero page).
    pub placed: Mutex<Vec<(u64, Option<Vec<u8>>)>>,
    /// Copies fail with this, when set (zero pages do not).
    pub copy_fails: Mutex<Option<Errno>>,
}

/// What the lazy-restore guard's stand-in does: takes the first message (what it is to hold),
/// says it holds it, and waits until stasisd lets it go.
const GUARD: &str = "#!/bin/sh\nhead -c1 >/dev/null && printf k >&0 && exec cat >/dev/null\n";

impl FakeHost {
    /// Installs a stand-in for stasis-lazy-guard in `dir`, as this host's helper program.
    pub fn install_guard(&self, dir: &Path) {
        let path = dir.join("stasis-lazy-guard");
        std::fs::write(&path, GUARD).unwrap();
        std::fs::set_permissions(&path, std::fs::Permissions::from_mode(0o755)).unwrap();
        self.helpers.lock().unwrap().insert("stasis-lazy-guard", path);
    }
}

impl Userfaults for FakeHost {
    fn adopt_userfaultfd(&self, fd: OwnedFd) -> io::Result<Box<dyn FaultFd>> {
        self.check("adopt_userfaultfd")?;
        let pending = self.faults.at.lock().unwrap().clone();
        Ok(Box::new(FakeUffd { fd, faults: self.faults.clone(), pending: Mutex::new(pending) }))
    }
}

/// A userfaultfd: the descriptor CRIU handed over (polled, never read), the faults it has yet
/// to report.
struct FakeUffd {
    fd: OwnedFd,
    faults: Arc<FakeFaults>,
    pending: Mutex<Vec<u64>>,
}

impl AsFd for FakeUffd {
    fn as_fd(&self) -> BorrowedFd<'_> {
        self.fd.as_fd()
    }
}

impl FaultFd for FakeUffd {
    fn read_events(&self, out: &mut Vec<FaultEvent>) -> io::Result<()> {
        let pending = std::mem::take(&mut *self.pending.lock().unwrap());
        out.extend(pending.into_iter().map(|address| Event::PageFault { address }));
        Ok(())
    }

    fn register(&self, _start: u64, _len: u64) -> io::Result<()> {
        Ok(())
    }

    fn copy(&self, dst: u64, src: &[u8]) -> Result<(), FillError> {
        if let Some(errno) = *self.faults.copy_fails.lock().unwrap() {
            return Err(FillError { errno, done: 0 });
        }
        self.faults.placed.lock().unwrap().push((dst, Some(src.to_vec())));
        Ok(())
    }

    fn zero(&self, dst: u64, _len: u64) -> Result<(), FillError> {
        self.faults.placed.lock().unwrap().push((dst, None));
        Ok(())
    }

    fn wake(&self, _start: u64, _len: u64) -> io::Result<()> {
        Ok(())
    }
}
