//! A CRIU for tests of the engine's jobs: it runs nothing, and does what it is told (dump
//! some pages to stasisd's page server and succeed, or fail; restore a pid, or fail; hand
//! the restored pid's memory to stasisd's lazy-pages socket), recording every call.

use std::io::{Read, Write};
use std::os::fd::{AsFd, RawFd};
use std::os::unix::net::UnixStream;
use std::path::Path;
use std::sync::Mutex;

use nix::sys::eventfd::{EfdFlags, EventFd};
use stasis_criu_images::pages::{PE_LAZY, PE_PARENT, PE_PRESENT};

use super::lazy_socket::client;
use super::pageserver::{HeaderLayout, IOV_ADD_F, IOV_CLOSE, IOV_OPEN, IOV_OPEN2};
use super::{CriuError, CriuOps, CriuVersion, DumpSpec, OnNotify, RestoreSpec};

/// The pid the fake says it runs as, in its notifications: above Linux's largest pid_max, so
/// that no real process has it.
pub const FAKE_CRIU_PID: i32 = 4_194_300;

/// What the fake does when asked to dump or restore.
pub type Hook<T> = Box<dyn Fn(&T) + Send + Sync>;

pub struct FakeCriu {
    pub version: CriuVersion,
    /// Dumps fail with this log line when set.
    pub fail_dump: Option<String>,
    /// Restores fail with this log line when set; else they answer `restored_pid`.
    pub fail_restore: Option<String>,
    pub restored_pid: i32,
    /// The page it dumps is one a lazy restore may leave in the store (CRIU's lazy flag); a
    /// restore with lazy pages then announces `restored_pid` on the lazy-pages socket (an
    /// eventfd in place of its userfaultfd), says the restore finished and notifies
    /// "pre-resume", once the tree is restored; a failed notification fails the restore.
    pub lazy: bool,
    /// Run on a dump that succeeds, before it answers (e.g. to stop the tree).
    pub on_dump: Option<Hook<DumpSpec>>,
    /// Run on a dump that fails, before it answers (e.g. to have the tree die with it).
    pub on_failed_dump: Option<Hook<DumpSpec>>,
    /// Run on a restore that succeeds, before it answers (e.g. to start the tree).
    pub on_restore: Option<Hook<RestoreSpec>>,
    pub calls: Mutex<Vec<String>>,
}

impl Default for FakeCriu {
    fn default() -> Self {
        FakeCriu {
            version: CriuVersion { major: 4, minor: 2, sublevel: 1 },
            fail_dump: None,
            fail_restore: None,
            restored_pid: 0,
            lazy: false,
            on_dump: None,
            on_failed_dump: None,
            on_restore: None,
            calls: Mutex::new(Vec::new()),
        }
    }
}

impl std::fmt::Debug for FakeCriu {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("FakeCriu").field("calls", &self.calls).finish_non_exhaustive()
    }
}

impl FakeCriu {
    pub fn calls(&self) -> Vec<String> {
        self.calls.lock().unwrap().clone()
    }

    /// Sends one page of `pid` at 0x10000 to the page server on `fd` (opening its pagemap
    /// first), then closes the session the way CRIU does. A dump with a parent asks whether
    /// the page server has one for the pagemap, and if so sends the page as unchanged (in
    /// parent), as CRIU does for a page not written since.
    fn send_pages(&self, fd: RawFd, pid: i32, parent: bool) -> Result<(), CriuError> {
        let layout = HeaderLayout::for_version(self.version.major, self.version.minor);
        let mut conn = UnixStream::from(stasis_linux::sys::duplicate(fd).map_err(CriuError::Io)?);
        let dst_id = ((pid as u64) << 8) | 1;
        let mut in_parent = false;
        let mut message = Vec::new();
        if parent {
            conn.write_all(&layout.encode(IOV_OPEN2, 0, 0, dst_id)).map_err(CriuError::Io)?;
            let mut has = [0u8];
            conn.read_exact(&mut has).map_err(CriuError::Io)?;
            in_parent = has[0] == 1;
        } else {
            message.extend(layout.encode(IOV_OPEN, 0, 0, dst_id));
        }
        if in_parent {
            message.extend(layout.encode(IOV_ADD_F | (PE_PARENT << 16), 1, 0x10000, dst_id));
        } else {
            let flags = if self.lazy { PE_PRESENT | PE_LAZY } else { PE_PRESENT };
            message.extend(layout.encode(IOV_ADD_F | (flags << 16), 1, 0x10000, dst_id));
            message.extend(std::iter::repeat_n(0x5a, 4096));
        }
        message.extend(layout.encode(IOV_CLOSE, 0, 0, 0));
        conn.write_all(&message).map_err(CriuError::Io)?;
        let mut answer = [0u8; 4];
        conn.read_exact(&mut answer).map_err(CriuError::Io)
    }
}

fn failure(line: &str) -> CriuError {
    CriuError::Failed { operation: "fake", message: line.into(), log_tail: line.into() }
}

impl CriuOps for FakeCriu {
    fn path(&self) -> &Path {
        Path::new("/fake/criu")
    }

    fn version(&self) -> Result<CriuVersion, CriuError> {
        Ok(self.version)
    }

    fn check(&self, _work_dir: &Path) -> Result<(), CriuError> {
        Ok(())
    }

    fn supports_nftables(&self) -> bool {
        true
    }

    fn dump(&self, spec: &DumpSpec, _on_notify: OnNotify<'_>) -> Result<(), CriuError> {
        self.calls.lock().unwrap().push(format!("dump {}", spec.pid));
        if let Some(line) = &self.fail_dump {
            if let Some(hook) = &self.on_failed_dump {
                hook(spec);
            }
            return Err(failure(line));
        }
        if let Some(fd) = spec.page_server_fd {
            self.send_pages(fd, spec.pid, spec.track_mem && spec.parent.is_some())?;
        }
        // The images CRIU writes beside the pages: a whole set with the page server's pagemap.
        stasis_criu_images::testing::write_dump_images(&spec.images_dir, spec.pid as u32, &[]);
        if let Some(hook) = &self.on_dump {
            hook(spec);
        }
        Ok(())
    }

    fn restore(&self, spec: &RestoreSpec, on_notify: OnNotify<'_>) -> Result<i32, CriuError> {
        self.calls.lock().unwrap().push(format!("restore {}", spec.images_dir.display()));
        if let Some(line) = &self.fail_restore {
            return Err(failure(line));
        }
        if let Some(hook) = &self.on_restore {
            hook(spec);
        }
        if self.lazy && spec.lazy_pages {
            let mut conn = client::connect_in(&spec.images_dir).map_err(CriuError::Io)?;
            let uffd = EventFd::from_flags(EfdFlags::EFD_CLOEXEC).map_err(|e| CriuError::Io(e.into()))?;
            client::announce(&mut conn, self.restored_pid, uffd.as_fd()).map_err(CriuError::Io)?;
            client::finish(&mut conn).map_err(CriuError::Io)?;
            // CRIU only logs a failed notification, but stasisd kills the tree when it fails
            // one, and resuming a killed tree fails.
            if let Err(why) = on_notify("pre-resume", FAKE_CRIU_PID) {
                return Err(failure(&format!("Error: the tree died at pre-resume ({why})")));
            }
        }
        Ok(self.restored_pid)
    }
}
