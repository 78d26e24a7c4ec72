//! The restore side of CRIU's lazy-pages protocol, with stasisd in the lazy-pages daemon's
//! place.
//!
//! ```text
//! stasisd: bind + listen  <work dir>/lazy-pages.socket (stream)
//! criu restore --lazy-pages: connect (before it forks the tree)
//!   per process of pstree.img, in any order:
//!     live:   pid (i32, native endian), then one byte carrying its userfaultfd (SCM_RIGHTS)
//!     zombie: -pid, nothing else
//!   once every task is restored, before any runs: 0x52535446 ("ReSTore Finished", u32)
//! ```
//! A userfaultfd arrives before the restorer registers the process's lazy mappings with it;
//! they are all registered by "restore finished". The connection stays open until CRIU's
//! restore ends.

use std::collections::VecDeque;
use std::io;
use std::os::fd::{AsFd, AsRawFd, BorrowedFd, OwnedFd};
use std::os::unix::net::{UnixListener, UnixStream};
use std::path::{Path, PathBuf};

use stasis_linux::sys::recv_with_fds;

/// The socket's name, in the restore's work directory (CRIU connects to it by this relative
/// name from there).
pub const SOCKET_NAME: &str = "lazy-pages.socket";
/// The word CRIU sends once every task is restored.
const RESTORE_FINISHED: u32 = 0x5253_5446;

/// The restore broke the protocol.
#[derive(Debug, thiserror::Error)]
pub enum LazySocketError {
    #[error("reading CRIU's lazy-pages connection failed")]
    Io(#[from] io::Error),
    #[error("CRIU closed its lazy-pages connection {0}")]
    Closed(&'static str),
    #[error("CRIU announced pid {pid} without its userfaultfd")]
    NoDescriptor { pid: i32 },
    #[error("CRIU sent {0:#x} where it announces the restore finished")]
    NotFinished(u32),
    #[error("CRIU announced more processes than the checkpoint holds ({0})")]
    TooMany(usize),
}

/// What CRIU said.
#[derive(Debug)]
pub enum Announcement {
    /// Process `pid` (as the checkpoint numbers it) and the userfaultfd of its memory.
    Task { pid: i32, uffd: OwnedFd },
    /// A zombie of the tree: nothing to serve.
    Zombie { pid: i32 },
    /// Every task is restored; none runs yet.
    Finished,
}

/// The listening socket, until CRIU connects.
pub struct LazyListener {
    listener: UnixListener,
    path: PathBuf,
}

impl LazyListener {
    /// Listens on [`SOCKET_NAME`] in `work_dir` (non-blocking). The directory is reached
    /// through a descriptor of it, so that its path may be longer than a socket address holds.
    pub fn bind(work_dir: &Path) -> io::Result<LazyListener> {
        let path = work_dir.join(SOCKET_NAME);
        match std::fs::remove_file(&path) {
            Err(e) if e.kind() != io::ErrorKind::NotFound => return Err(e),
            _ => {}
        }
        let dir = std::fs::File::open(work_dir)?;
        let short = format!("/proc/self/fd/{}/{SOCKET_NAME}", dir.as_raw_fd());
        let listener = UnixListener::bind(short)?;
        listener.set_nonblocking(true)?;
        Ok(LazyListener { listener, path })
    }

    /// CRIU's connection, if it connected; it announces `processes` processes.
    pub fn accept(&self, processes: usize) -> io::Result<Option<RestoreConnection>> {
        match self.listener.accept() {
            Ok((stream, _)) => {
                stream.set_nonblocking(true)?;
                Ok(Some(RestoreConnection::new(stream, processes)))
            }
            Err(e) if e.kind() == io::ErrorKind::WouldBlock => Ok(None),
            Err(e) => Err(e),
        }
    }
}

impl AsFd for LazyListener {
    fn as_fd(&self) -> BorrowedFd<'_> {
        self.listener.as_fd()
    }
}

impl Drop for LazyListener {
    fn drop(&mut self) {
        let _ = std::fs::remove_file(&self.path);
    }
}

/// CRIU's restore, connected.
pub struct RestoreConnection {
    stream: UnixStream,
    /// Bytes received and not yet understood.
    bytes: VecDeque<u8>,
    fds: VecDeque<OwnedFd>,
    /// Processes not yet announced.
    left: usize,
    finished: bool,
}

impl RestoreConnection {
    fn new(stream: UnixStream, processes: usize) -> RestoreConnection {
        RestoreConnection {
            stream,
            bytes: VecDeque::new(),
            fds: VecDeque::new(),
            left: processes,
            finished: false,
        }
    }

    /// Whether CRIU said the restore finished.
    pub fn finished(&self) -> bool {
        self.finished
    }

    /// Reads what CRIU sent since (without waiting) and returns what it announced. After
    /// "finished" CRIU says nothing more; its closing the connection then is no error.
    pub fn read(&mut self) -> Result<Vec<Announcement>, LazySocketError> {
        let mut out = Vec::new();
        loop {
            let mut buf = [0u8; 256];
            let Some((n, fds)) = recv_with_fds(self.stream.as_fd(), &mut buf)? else { break };
            self.fds.extend(fds);
            if n == 0 {
                self.parse(&mut out)?;
                if self.finished {
                    break;
                }
                let when = if self.left > 0 {
                    "before announcing every process"
                } else {
                    "before the restore finished"
                };
                return Err(LazySocketError::Closed(when));
            }
            self.bytes.extend(&buf[..n]);
        }
        self.parse(&mut out)?;
        Ok(out)
    }

    /// Turns the bytes received into announcements, as far as they go.
    fn parse(&mut self, out: &mut Vec<Announcement>) -> Result<(), LazySocketError> {
        while self.bytes.len() >= 4 && !self.finished {
            let word: [u8; 4] = [self.bytes[0], self.bytes[1], self.bytes[2], self.bytes[3]];
            if self.left == 0 {
                let word = u32::from_ne_bytes(word);
                if word != RESTORE_FINISHED {
                    return Err(LazySocketError::NotFinished(word));
                }
                self.bytes.drain(..4);
                self.finished = true;
                out.push(Announcement::Finished);
                continue;
            }
            let pid = i32::from_ne_bytes(word);
            if pid < 0 {
                self.bytes.drain(..4);
                self.left -= 1;
                out.push(Announcement::Zombie { pid: -pid });
                continue;
            }
            // A live task's pid is followed by the byte that carried its descriptor.
            if self.bytes.len() < 5 {
                break;
            }
            let uffd = self.fds.pop_front().ok_or(LazySocketError::NoDescriptor { pid })?;
            self.bytes.drain(..5);
            self.left -= 1;
            out.push(Announcement::Task { pid, uffd });
        }
        if self.left == 0 && !self.finished && !self.fds.is_empty() {
            return Err(LazySocketError::TooMany(self.fds.len()));
        }
        Ok(())
    }
}

impl AsFd for RestoreConnection {
    fn as_fd(&self) -> BorrowedFd<'_> {
        self.stream.as_fd()
    }
}

/// CRIU's side of the protocol, for tests and the fake CRIU.
#[cfg(any(test, feature = "testing"))]
pub(crate) mod client {
    use std::io::{self, IoSlice, Write};
    use std::os::fd::{AsRawFd, BorrowedFd};
    use std::os::unix::net::UnixStream;
    use std::path::Path;

    use nix::sys::socket::{ControlMessage, MsgFlags, sendmsg};

    use super::{RESTORE_FINISHED, SOCKET_NAME};

    /// Connects to the socket in `dir` as CRIU does, by its name relative to the directory
    /// (through a descriptor of it: the caller cannot change its working directory).
    pub fn connect_in(dir: &Path) -> io::Result<UnixStream> {
        let dir = std::fs::File::open(dir)?;
        UnixStream::connect(format!("/proc/self/fd/{}/{SOCKET_NAME}", dir.as_raw_fd()))
    }

    /// Sends what CRIU's restore sends for a live task: its pid, and `fd` as its userfaultfd.
    pub fn announce(client: &mut UnixStream, pid: i32, fd: BorrowedFd<'_>) -> io::Result<()> {
        client.write_all(&pid.to_ne_bytes())?;
        let fds = [fd.as_raw_fd()];
        let rights = [ControlMessage::ScmRights(&fds)];
        sendmsg::<()>(client.as_raw_fd(), &[IoSlice::new(&[0])], &rights, MsgFlags::empty(), None)?;
        Ok(())
    }

    /// Says the restore finished.
    pub fn finish(client: &mut UnixStream) -> io::Result<()> {
        client.write_all(&RESTORE_FINISHED.to_ne_bytes())
    }
}

#[cfg(test)]
mod tests {
    use super::client::{announce, connect_in};
    use super::*;
    use std::io::Write;

    /// Reads from `conn` until `count` announcements came.
    fn until(conn: &mut RestoreConnection, count: usize) -> Vec<Announcement> {
        let mut got = Vec::new();
        for _ in 0..1000 {
            got.extend(conn.read().unwrap());
            if got.len() >= count {
                return got;
            }
            std::thread::sleep(std::time::Duration::from_millis(1));
        }
        panic!("only {got:?}");
    }

    #[test]
    fn tasks_zombies_and_the_end_of_the_restore() {
        // A work directory whose path is longer than a socket address holds.
        let top = tempfile::tempdir().unwrap();
        let dir = top.path().join("a-rather-long-directory-name-".repeat(4));
        std::fs::create_dir(&dir).unwrap();
        let dir = tempfile::TempDir::new_in(&dir).unwrap();
        assert!(dir.path().join(SOCKET_NAME).as_os_str().len() > 108);
        let listener = LazyListener::bind(dir.path()).unwrap();
        assert!(listener.accept(3).unwrap().is_none(), "nobody connected yet");
        let mut client = connect_in(dir.path()).unwrap();
        let mut conn = listener.accept(3).unwrap().expect("the restore's connection");
        let (a, b) = (std::fs::File::open("/dev/null").unwrap(), std::fs::File::open("/dev/zero").unwrap());
        announce(&mut client, 7, a.as_fd()).unwrap();
        client.write_all(&(-9i32).to_ne_bytes()).unwrap();
        announce(&mut client, 8, b.as_fd()).unwrap();
        let got = until(&mut conn, 3);
        assert!(matches!(got[0], Announcement::Task { pid: 7, .. }), "{got:?}");
        assert!(matches!(got[1], Announcement::Zombie { pid: 9 }), "{got:?}");
        let Announcement::Task { pid: 8, uffd } = &got[2] else { panic!("{got:?}") };
        assert!(uffd.as_raw_fd() != b.as_raw_fd(), "a descriptor of its own");
        assert!(!conn.finished());
        super::client::finish(&mut client).unwrap();
        assert!(matches!(until(&mut conn, 1)[..], [Announcement::Finished]));
        drop(client);
        assert!(conn.read().unwrap().is_empty(), "closing after the end is no error");
        drop(listener);
        assert!(!dir.path().join(SOCKET_NAME).exists(), "the socket file goes with the listener");
    }

    #[test]
    fn a_restore_that_ends_early_or_garbles_is_an_error() {
        let dir = tempfile::tempdir().unwrap();
        let listener = LazyListener::bind(dir.path()).unwrap();
        let client = UnixStream::connect(dir.path().join(SOCKET_NAME)).unwrap();
        let mut conn = listener.accept(2).unwrap().unwrap();
        drop(client);
        assert!(matches!(conn.read(), Err(LazySocketError::Closed(_))));

        let mut client = UnixStream::connect(dir.path().join(SOCKET_NAME)).unwrap();
        let mut conn = listener.accept(1).unwrap().unwrap();
        client.write_all(&5i32.to_ne_bytes()).unwrap();
        client.write_all(&[0]).unwrap();
        std::thread::sleep(std::time::Duration::from_millis(20));
        assert!(matches!(conn.read(), Err(LazySocketError::NoDescriptor { pid: 5 })));

        let mut client = UnixStream::connect(dir.path().join(SOCKET_NAME)).unwrap();
        let mut conn = listener.accept(0).unwrap().unwrap();
        client.write_all(&1234u32.to_ne_bytes()).unwrap();
        std::thread::sleep(std::time::Duration::from_millis(20));
        assert!(matches!(conn.read(), Err(LazySocketError::NotFinished(1234))));
    }
}
