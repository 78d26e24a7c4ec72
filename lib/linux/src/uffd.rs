//! userfaultfd(2): the kernel's hook for filling a process's missing pages from outside it.
//!
//! CRIU's lazy restore gives stasisd one userfaultfd per restored process, registered (in
//! "missing" mode) over the private anonymous memory it left empty. Reading one yields events
//! in 32-byte `struct uffd_msg`s: page faults, and the mapping changes a non-cooperative
//! handler must follow (fork, mremap, munmap, madvise(DONTNEED)). Pages are put in place with
//! `UFFDIO_COPY` (and `UFFDIO_ZEROPAGE` for zeros), which also wake the threads waiting on
//! them. The ioctls are this module's only unsafe code.

use std::io;
use std::os::fd::{AsFd, AsRawFd, BorrowedFd, FromRawFd, OwnedFd, RawFd};

use nix::errno::Errno;

/// Size of `struct uffd_msg`.
const MSG_LEN: usize = 32;
const UFFD_API: u64 = 0xaa;
const EVENT_PAGEFAULT: u8 = 0x12;
const EVENT_FORK: u8 = 0x13;
const EVENT_REMAP: u8 = 0x14;
const EVENT_REMOVE: u8 = 0x15;
const EVENT_UNMAP: u8 = 0x16;

/// The non-cooperative events CRIU asks for (where the kernel has them): fork, remap, remove,
/// unmap (`UFFD_FEATURE_EVENT_*`).
pub const EVENT_FEATURES: u64 = (1 << 1) | (1 << 2) | (1 << 3) | (1 << 6);
const REGISTER_MODE_MISSING: u64 = 1;

#[repr(C)]
struct UffdioApi {
    api: u64,
    features: u64,
    ioctls: u64,
}

#[repr(C)]
struct UffdioRange {
    start: u64,
    len: u64,
}

#[repr(C)]
struct UffdioRegister {
    range: UffdioRange,
    mode: u64,
    ioctls: u64,
}

#[repr(C)]
struct UffdioCopy {
    dst: u64,
    src: u64,
    len: u64,
    mode: u64,
    copy: i64,
}

#[repr(C)]
struct UffdioZeropage {
    range: UffdioRange,
    mode: u64,
    zeropage: i64,
}

nix::ioctl_readwrite!(uffdio_api, 0xaa, 0x3f, UffdioApi);
nix::ioctl_readwrite!(uffdio_register, 0xaa, 0x00, UffdioRegister);
nix::ioctl_read!(uffdio_wake, 0xaa, 0x02, UffdioRange);
nix::ioctl_readwrite!(uffdio_copy, 0xaa, 0x03, UffdioCopy);
nix::ioctl_readwrite!(uffdio_zeropage, 0xaa, 0x04, UffdioZeropage);

/// What happened in the process a userfaultfd watches; `F` is what a forked child's memory is
/// watched through (a [`Userfaultfd`], as read here).
#[derive(Debug)]
pub enum Event<F = Userfaultfd> {
    /// A thread touched a missing page at `address` and waits for it.
    PageFault { address: u64 },
    /// The process forked: the child's memory is watched through `child`.
    Fork { child: F },
    /// `[from, from + len)` moved to `to` (mremap).
    Remap { from: u64, to: u64, len: u64 },
    /// `[start, end)` was emptied (madvise DONTNEED or REMOVE): it reads zeros now.
    Remove { start: u64, end: u64 },
    /// `[start, end)` was unmapped.
    Unmap { start: u64, end: u64 },
}

impl<F> Event<F> {
    /// The same event, a forked child's userfaultfd made into what `wrap` makes of it.
    pub fn map_child<G>(self, wrap: impl FnOnce(F) -> G) -> Event<G> {
        match self {
            Event::PageFault { address } => Event::PageFault { address },
            Event::Fork { child } => Event::Fork { child: wrap(child) },
            Event::Remap { from, to, len } => Event::Remap { from, to, len },
            Event::Remove { start, end } => Event::Remove { start, end },
            Event::Unmap { start, end } => Event::Unmap { start, end },
        }
    }
}

/// Why filling a range stopped, and how many of its bytes were filled before.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct FillError {
    pub errno: Errno,
    pub done: u64,
}

impl FillError {
    /// The page at `done` is already there (filled by an earlier copy, or by the process).
    pub fn exists(&self) -> bool {
        self.errno == Errno::EEXIST
    }

    /// The process's mappings are changing: its events must be read before trying again.
    pub fn again(&self) -> bool {
        self.errno == Errno::EAGAIN
    }

    /// The range is not (or no longer wholly) in one registered mapping.
    pub fn no_mapping(&self) -> bool {
        self.errno == Errno::ENOENT
    }

    /// The process has exited.
    pub fn gone(&self) -> bool {
        matches!(self.errno, Errno::ESRCH | Errno::ENOSPC)
    }
}

/// A userfaultfd.
#[derive(Debug)]
pub struct Userfaultfd {
    fd: OwnedFd,
}

impl Userfaultfd {
    /// Takes over a userfaultfd received from CRIU (already through its API handshake), made
    /// non-blocking (CRIU opens it so; a blocking one would hang whoever reads it).
    pub fn from_fd(fd: OwnedFd) -> io::Result<Userfaultfd> {
        let flags = nix::fcntl::fcntl(&fd, nix::fcntl::FcntlArg::F_GETFL)?;
        let flags = nix::fcntl::OFlag::from_bits_retain(flags) | nix::fcntl::OFlag::O_NONBLOCK;
        nix::fcntl::fcntl(&fd, nix::fcntl::FcntlArg::F_SETFL(flags))?;
        Ok(Userfaultfd { fd })
    }

    /// A new non-blocking userfaultfd of this process, with `features`: how stasisd learns
    /// whether this kernel can serve a lazy restore, and how tests make one.
    pub fn open(features: u64) -> io::Result<Userfaultfd> {
        // SAFETY: userfaultfd takes flags by value and returns a new descriptor or -1.
        let fd = unsafe { libc::syscall(libc::SYS_userfaultfd, libc::O_CLOEXEC | libc::O_NONBLOCK) };
        if fd < 0 {
            return Err(io::Error::last_os_error());
        }
        // SAFETY: the kernel just returned this descriptor to us and nothing else owns it.
        let fd = unsafe { OwnedFd::from_raw_fd(fd as RawFd) };
        let mut api = UffdioApi { api: UFFD_API, features, ioctls: 0 };
        // SAFETY: UFFDIO_API reads and writes the live struct `api`, sized as the kernel expects.
        unsafe { uffdio_api(fd.as_raw_fd(), &mut api) }?;
        Ok(Userfaultfd { fd })
    }

    /// Registers `[start, start + len)` of this process for missing-page faults.
    pub fn register(&self, start: u64, len: u64) -> io::Result<()> {
        let mut reg =
            UffdioRegister { range: UffdioRange { start, len }, mode: REGISTER_MODE_MISSING, ioctls: 0 };
        // SAFETY: UFFDIO_REGISTER reads and writes the live struct `reg`; it changes mappings
        // of this process only as a registration, never their contents.
        unsafe { uffdio_register(self.fd.as_raw_fd(), &mut reg) }?;
        Ok(())
    }

    /// The events waiting, appended to `out`; none (not an error) when nothing waits.
    pub fn read_events(&self, out: &mut Vec<Event>) -> io::Result<()> {
        let mut buf = [0u8; MSG_LEN * 16];
        loop {
            let n = match nix::unistd::read(&self.fd, &mut buf) {
                Ok(n) => n,
                Err(Errno::EAGAIN) => return Ok(()),
                Err(Errno::EINTR) => continue,
                Err(e) => return Err(e.into()),
            };
            if n == 0 {
                return Ok(());
            }
            out.extend(buf[..n].chunks_exact(MSG_LEN).filter_map(parse));
            if n < buf.len() {
                return Ok(());
            }
        }
    }

    /// Copies `src` to `dst` in the watched process and wakes what waits on those pages.
    pub fn copy(&self, dst: u64, src: &[u8]) -> Result<(), FillError> {
        let mut op = UffdioCopy { dst, src: src.as_ptr() as u64, len: src.len() as u64, mode: 0, copy: 0 };
        // SAFETY: UFFDIO_COPY reads `src.len()` bytes from `src`, a live slice, and writes only
        // into the watched process (and the live struct `op`).
        let result = unsafe { uffdio_copy(self.fd.as_raw_fd(), &mut op) };
        result.map(drop).map_err(|errno| FillError { errno, done: op.copy.max(0) as u64 })
    }

    /// Maps zero pages over `[dst, dst + len)` in the watched process and wakes what waits.
    pub fn zero(&self, dst: u64, len: u64) -> Result<(), FillError> {
        let mut op = UffdioZeropage { range: UffdioRange { start: dst, len }, mode: 0, zeropage: 0 };
        // SAFETY: UFFDIO_ZEROPAGE reads and writes the live struct `op` and changes only the
        // watched process's memory.
        let result = unsafe { uffdio_zeropage(self.fd.as_raw_fd(), &mut op) };
        result.map(drop).map_err(|errno| FillError { errno, done: op.zeropage.max(0) as u64 })
    }

    /// Wakes the threads waiting on `[start, start + len)` (pages that are there already).
    pub fn wake(&self, start: u64, len: u64) -> io::Result<()> {
        let mut range = UffdioRange { start, len };
        // SAFETY: UFFDIO_WAKE only reads the live struct `range`.
        unsafe { uffdio_wake(self.fd.as_raw_fd(), &mut range) }?;
        Ok(())
    }
}

impl AsFd for Userfaultfd {
    fn as_fd(&self) -> BorrowedFd<'_> {
        self.fd.as_fd()
    }
}

/// One `struct uffd_msg`; `None` for an event of a kind this handler does not ask for (none
/// comes unless asked for).
fn parse(msg: &[u8]) -> Option<Event> {
    let word = |at: usize| u64::from_ne_bytes(msg[at..at + 8].try_into().unwrap_or_default());
    Some(match msg[0] {
        EVENT_PAGEFAULT => Event::PageFault { address: word(16) },
        EVENT_FORK => {
            let fd = u32::from_ne_bytes(msg[8..12].try_into().unwrap_or_default()) as RawFd;
            // SAFETY: the kernel installed this descriptor in our table for this message; it
            // is ours alone.
            Event::Fork { child: Userfaultfd { fd: unsafe { OwnedFd::from_raw_fd(fd) } } }
        }
        EVENT_REMAP => Event::Remap { from: word(8), to: word(16), len: word(24) },
        EVENT_REMOVE => Event::Remove { start: word(8), end: word(16) },
        EVENT_UNMAP => Event::Unmap { start: word(8), end: word(16) },
        _ => return None,
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    const PAGE: usize = 4096;

    /// Anonymous memory of `pages` pages, registered with a new userfaultfd.
    fn watched(pages: usize) -> (Userfaultfd, memmap2::MmapMut) {
        let uffd =
            Userfaultfd::open(EVENT_FEATURES).expect("userfaultfd (root, kernel with CONFIG_USERFAULTFD)");
        let map = memmap2::MmapMut::map_anon(pages * PAGE).unwrap();
        uffd.register(map.as_ptr() as u64, (pages * PAGE) as u64).unwrap();
        (uffd, map)
    }

    #[test]
    fn a_fault_waits_for_its_page_and_sees_what_was_copied() {
        let (uffd, map) = watched(4);
        let base = map.as_ptr() as u64;
        // (The mapping comes back: unmapping it would wait until its event is read.)
        let reader = std::thread::spawn(move || (map[PAGE + 5], map));
        let address = loop {
            let mut events = Vec::new();
            uffd.read_events(&mut events).unwrap();
            if let Some(Event::PageFault { address }) = events.pop() {
                break address;
            }
            std::thread::sleep(std::time::Duration::from_millis(1));
        };
        assert_eq!(address & !(PAGE as u64 - 1), base + PAGE as u64);
        // Two pages at once; the second copy of one of them finds it there.
        let data: Vec<u8> = (0..2 * PAGE).map(|i| (i % 200) as u8).collect();
        uffd.copy(base + PAGE as u64, &data).unwrap();
        let (read, map) = reader.join().unwrap();
        assert_eq!(read, 5);
        let again = uffd.copy(base + 2 * PAGE as u64, &data[..PAGE]).unwrap_err();
        assert!(again.exists() && again.done == 0, "{again:?}");
        uffd.zero(base, PAGE as u64).unwrap();
        let outside = uffd.copy(base + 4 * PAGE as u64, &data[..PAGE]).unwrap_err();
        assert!(outside.no_mapping(), "{outside:?}");
        // Without the userfaultfd the memory is an ordinary mapping again.
        drop(uffd);
        assert_eq!(map[2 * PAGE + 1], ((PAGE + 1) % 200) as u8);
        assert_eq!(map[0], 0);
    }

    /// The events of `uffd` until `count` arrived (the process waits until they are read).
    fn events(uffd: &Userfaultfd, count: usize) -> Vec<Event> {
        let mut events = Vec::new();
        while events.len() < count {
            uffd.read_events(&mut events).unwrap();
            std::thread::sleep(std::time::Duration::from_millis(1));
        }
        events
    }

    #[test]
    fn mapping_changes_are_events() {
        let (uffd, mut map) = watched(8);
        let base = map.as_ptr() as u64;
        // The change waits until its event is read, so it runs on another thread.
        let dontneed = std::thread::spawn(move || {
            // SAFETY: the test owns `map`; DONTNEED on its anonymous pages only empties them.
            unsafe { libc::madvise(map.as_mut_ptr().add(2 * PAGE).cast(), PAGE, libc::MADV_DONTNEED) };
            map
        });
        let removed = events(&uffd, 1);
        let map = dontneed.join().unwrap();
        let (start, end) = (base + 2 * PAGE as u64, base + 3 * PAGE as u64);
        assert!(
            matches!(removed[..], [Event::Remove { start: s, end: e }] if (s, e) == (start, end)),
            "{removed:?}"
        );
        let unmap = std::thread::spawn(move || drop(map));
        let unmapped = events(&uffd, 1);
        unmap.join().unwrap();
        assert!(matches!(unmapped[..], [Event::Unmap { start, .. }] if start == base), "{unmapped:?}");
    }

    #[test]
    fn messages_parse_and_unknown_ones_are_skipped() {
        let mut msg = [0u8; MSG_LEN];
        msg[0] = EVENT_REMAP;
        msg[8..16].copy_from_slice(&0x1000u64.to_ne_bytes());
        msg[16..24].copy_from_slice(&0x9000u64.to_ne_bytes());
        msg[24..32].copy_from_slice(&0x2000u64.to_ne_bytes());
        assert!(matches!(parse(&msg), Some(Event::Remap { from: 0x1000, to: 0x9000, len: 0x2000 })));
        msg[0] = 0x7f;
        assert!(parse(&msg).is_none());
    }
}
