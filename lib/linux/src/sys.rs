//! The few operations that need `unsafe`: code that runs in a forked child before `exec`,
//! mapping a private file, taking a copy of another process's descriptor, asking a
//! socket for its address family, a thread that takes another user's ids to ask what they may
//! open; and the allocator's thresholds.
//!
//! Between `fork` and `exec` only async-signal-safe calls are allowed, so these closures use
//! raw `libc` calls on values prepared beforehand and never allocate.

use std::io;
use std::os::fd::{AsRawFd, BorrowedFd, FromRawFd, OwnedFd, RawFd};
use std::os::unix::process::CommandExt;
use std::process::{Child, Command};

/// What to set up in the child between `fork` and `exec`.
#[derive(Debug, Default, Clone)]
pub struct ChildSetup {
    /// Start a new session (the child becomes session and process-group leader).
    pub new_session: bool,
    /// Open `cgroup.procs` files the child writes itself into (one per hierarchy).
    pub cgroup_procs: Vec<RawFd>,
    /// Descriptors the child keeps across `exec` (their close-on-exec flag is cleared).
    pub keep_fds: Vec<RawFd>,
    /// Unshare a new pid namespace: the child's own children are numbered in it, the first
    /// being its pid 1 (see `stasis-init`).
    pub new_pid_ns: bool,
}

/// Descriptors marked close-on-exec one by one where close_range(2) is refused.
const FALLBACK_FDS: i32 = 4096;

/// Spawns `cmd` with `setup` applied in the child.
pub fn spawn(cmd: &mut Command, setup: ChildSetup) -> io::Result<Child> {
    let ChildSetup { new_session, cgroup_procs, keep_fds, new_pid_ns } = setup;
    // SAFETY: the closure runs in the forked child before exec. It only calls setsid, write,
    // unshare, close_range and fcntl (all async-signal-safe) on integers captured by value, and it does not
    // allocate or touch locks shared with the parent.
    unsafe {
        cmd.pre_exec(move || {
            if new_session && libc::setsid() < 0 {
                return Err(io::Error::last_os_error());
            }
            if new_pid_ns && libc::unshare(libc::CLONE_NEWPID) < 0 {
                return Err(io::Error::last_os_error());
            }
            for &fd in &cgroup_procs {
                // "0" names the writing process itself.
                if libc::write(fd, b"0".as_ptr().cast(), 1) < 0 {
                    return Err(io::Error::last_os_error());
                }
            }
            // Nothing stasisd inherited or opened passes to the child unless named: descriptors
            // from whoever started stasisd (a shell, a test runner) would otherwise end up in a
            // workload, and in its checkpoint. Stdio (0-2) is already in place.
            if libc::syscall(libc::SYS_close_range, 3u32, u32::MAX, libc::CLOSE_RANGE_CLOEXEC) < 0 {
                // A kernel before 5.11 (or a seccomp filter) refuses it: the usual range one by
                // one instead.
                for fd in 3..FALLBACK_FDS {
                    libc::fcntl(fd, libc::F_SETFD, libc::FD_CLOEXEC);
                }
            }
            for &fd in &keep_fds {
                if libc::fcntl(fd, libc::F_SETFD, 0) < 0 {
                    return Err(io::Error::last_os_error());
                }
            }
            Ok(())
        })
    };
    cmd.spawn()
}

/// Maps a file that only this process wrote, for reading; takes the caller's handle so that
/// nothing of ours writes it any more.
///
/// The caller promises the file is private to it: created exclusively, mode 0600, in the
/// daemon's own state directory, so no other process writes it either.
pub fn map_private_file(file: std::fs::File) -> io::Result<memmap2::Mmap> {
    // SAFETY: mapping is unsound only if the file changes while mapped; per this function's
    // contract nobody writes the file any more, so the mapped bytes stay as they are.
    unsafe { memmap2::Mmap::map(&file) }
}

/// Drops this process's mapping of `len` bytes at `offset` of a read-only file mapping, so
/// pages already read stop counting as its resident memory; reading them again faults the same
/// file contents back in. Errors are ignored: this only saves memory.
pub fn release_mapped_range(map: &memmap2::Mmap, offset: usize, len: usize) {
    // SAFETY: `map` is a read-only shared mapping of a file. MADV_DONTNEED on such a mapping
    // only discards page-table entries; the data stays in the file and later accesses read it
    // back unchanged, so no reference into the mapping can observe different bytes.
    let _ = unsafe { map.unchecked_advise_range(memmap2::UncheckedAdvice::DontNeed, offset, len) };
}

/// A descriptor of process `pid` (`pidfd_open(2)`, Linux 5.3): readable once it has exited.
pub fn pidfd_open(pid: i32) -> io::Result<OwnedFd> {
    // SAFETY: pidfd_open takes a pid and flags by value and returns a new descriptor or -1; no
    // memory is shared with the kernel.
    let pidfd = unsafe { libc::syscall(libc::SYS_pidfd_open, pid, 0) };
    if pidfd < 0 {
        return Err(io::Error::last_os_error());
    }
    // SAFETY: the kernel just returned this descriptor to us and nothing else owns it.
    Ok(unsafe { OwnedFd::from_raw_fd(pidfd as i32) })
}

/// Sends `signal` (0: none, only whether it could be) to the process `pidfd` refers to
/// (`pidfd_send_signal(2)`, Linux 5.1): `ESRCH` once it has been reaped, whatever process has
/// its pid since.
pub fn pidfd_send_signal(pidfd: BorrowedFd<'_>, signal: i32) -> io::Result<()> {
    // SAFETY: pidfd_send_signal takes a descriptor, a signal number, a null siginfo (the
    // kernel then fills one in as kill(2) would) and flags; nothing of ours is written.
    let rc = unsafe {
        libc::syscall(
            libc::SYS_pidfd_send_signal,
            pidfd.as_raw_fd(),
            signal,
            std::ptr::null::<libc::siginfo_t>(),
            0,
        )
    };
    if rc < 0 {
        return Err(io::Error::last_os_error());
    }
    Ok(())
}

/// A copy of descriptor `fd` of process `pid` (`pidfd_getfd(2)`; needs ptrace access to it).
pub fn copy_fd_of(pid: i32, fd: i32) -> io::Result<OwnedFd> {
    let pidfd = pidfd_open(pid)?;
    // SAFETY: pidfd_getfd takes two descriptors and flags by value and returns a new
    // descriptor or -1; no memory is shared with the kernel.
    let copy = unsafe { libc::syscall(libc::SYS_pidfd_getfd, pidfd.as_raw_fd(), fd, 0) };
    if copy < 0 {
        return Err(io::Error::last_os_error());
    }
    // SAFETY: as above, a fresh descriptor owned by nobody else.
    Ok(unsafe { OwnedFd::from_raw_fd(copy as i32) })
}

/// Whether this kernel has pidfd_open(2) and pidfd_getfd(2) (Linux 5.6), which stasisd uses to
/// look at a tree's sockets: copies a descriptor of its own.
pub fn pidfd_getfd_works() -> io::Result<()> {
    let file = std::fs::File::open("/dev/null")?;
    copy_fd_of(std::process::id() as i32, file.as_raw_fd()).map(drop)
}

/// The address family of a socket (`SO_DOMAIN`), which also answers for families whose
/// sockets have no name to ask for (AF_ALG).
pub fn socket_domain(socket: BorrowedFd<'_>) -> io::Result<i32> {
    let mut domain: libc::c_int = 0;
    let mut len = std::mem::size_of::<libc::c_int>() as libc::socklen_t;
    // SAFETY: getsockopt writes at most `len` bytes into `domain`, a live c_int whose size
    // `len` states, and updates `len`; both pointers are valid for the duration of the call.
    let rc = unsafe {
        libc::getsockopt(
            socket.as_raw_fd(),
            libc::SOL_SOCKET,
            libc::SO_DOMAIN,
            (&raw mut domain).cast(),
            &raw mut len,
        )
    };
    if rc < 0 {
        return Err(io::Error::last_os_error());
    }
    Ok(domain)
}

/// A descriptor of our own for `fd`, a descriptor this process holds (for test doubles of
/// programs that are handed raw descriptors, like CRIU).
#[cfg(any(test, feature = "testing"))]
pub fn duplicate(fd: RawFd) -> io::Result<OwnedFd> {
    // SAFETY: fcntl(F_DUPFD_CLOEXEC) takes integers by value and returns a new descriptor or
    // -1; it never touches memory, and an invalid `fd` makes it fail with EBADF.
    let copy = unsafe { libc::fcntl(fd, libc::F_DUPFD_CLOEXEC, 0) };
    if copy < 0 {
        return Err(io::Error::last_os_error());
    }
    // SAFETY: the kernel just returned this descriptor to us and nothing else owns it.
    Ok(unsafe { OwnedFd::from_raw_fd(copy) })
}

/// Attaches a classic BPF program to a socket (`SO_ATTACH_FILTER`): the kernel then queues only
/// the packets `program` accepts.
pub fn attach_filter(socket: BorrowedFd<'_>, program: &[libc::sock_filter]) -> io::Result<()> {
    let len = u16::try_from(program.len()).map_err(|_| io::Error::other("BPF program too long"))?;
    let fprog = libc::sock_fprog { len, filter: program.as_ptr().cast_mut() };
    // SAFETY: setsockopt reads `sizeof(sock_fprog)` bytes from `fprog`, which points at `len`
    // instructions of `program`; the kernel copies them before returning, and neither is
    // written to.
    let rc = unsafe {
        libc::setsockopt(
            socket.as_raw_fd(),
            libc::SOL_SOCKET,
            libc::SO_ATTACH_FILTER,
            (&raw const fprog).cast(),
            std::mem::size_of::<libc::sock_fprog>() as libc::socklen_t,
        )
    };
    if rc < 0 {
        return Err(io::Error::last_os_error());
    }
    Ok(())
}

/// Receives up to `buf.len()` bytes from a Unix socket without waiting, with the descriptors
/// they carry (SCM_RIGHTS, close-on-exec). `Ok(None)` when nothing is waiting; `Ok((0, _))`
/// at the end of the stream.
pub fn recv_with_fds(socket: BorrowedFd<'_>, buf: &mut [u8]) -> io::Result<Option<(usize, Vec<OwnedFd>)>> {
    use nix::sys::socket::{ControlMessageOwned, MsgFlags, recvmsg};
    // Room for as many as one message can carry (the kernel's SCM_MAX_FD): with less, the
    // rest would be closed and the message reported truncated.
    let mut space = nix::cmsg_space!([RawFd; 253]);
    let mut iov = [std::io::IoSliceMut::new(buf)];
    let flags = MsgFlags::MSG_DONTWAIT | MsgFlags::MSG_CMSG_CLOEXEC;
    let msg = loop {
        match recvmsg::<()>(socket.as_raw_fd(), &mut iov, Some(&mut space), flags) {
            Ok(msg) => break msg,
            Err(nix::errno::Errno::EINTR) => continue,
            Err(nix::errno::Errno::EAGAIN) => return Ok(None),
            Err(e) => return Err(e.into()),
        }
    };
    let mut fds = Vec::new();
    for cmsg in msg.cmsgs()? {
        if let ControlMessageOwned::ScmRights(received) = cmsg {
            // SAFETY: SCM_RIGHTS installed these descriptors in our table for this message;
            // nothing else knows them, so each gets exactly one owner.
            fds.extend(received.into_iter().map(|fd| unsafe { OwnedFd::from_raw_fd(fd) }));
        }
    }
    Ok(Some((msg.bytes, fds)))
}

/// `fd` registered with tokio's reactor, to wait on it without a thread.
pub fn async_fd(fd: OwnedFd) -> io::Result<tokio::io::unix::AsyncFd<OwnedFd>> {
    // SAFETY: the AsyncFd owns `fd`, an open descriptor that nothing else can close, and an
    // OwnedFd's `as_raw_fd` always returns the descriptor it holds, so it stays the same open
    // description for the AsyncFd's whole life.
    unsafe { tokio::io::unix::AsyncFd::register(fd) }.map_err(io::Error::from)
}

/// Whether processes `a` and `b` share one address space (a `vfork`ed child and its parent,
/// or a `clone(CLONE_VM)` pair), as `kcmp(KCMP_VM)` says.
pub fn share_memory(a: i32, b: i32) -> io::Result<bool> {
    const KCMP_VM: libc::c_int = 1;
    // SAFETY: kcmp takes two pids, a type and two plain integers, and touches no memory of
    // ours.
    let rc = unsafe { libc::syscall(libc::SYS_kcmp, a, b, KCMP_VM, 0, 0) };
    match rc {
        0 => Ok(true),
        rc if rc > 0 => Ok(false),
        _ => Err(io::Error::last_os_error()),
    }
}

/// `len` bytes at `addr` of process `pid`'s memory (`process_vm_readv`). A range not wholly
/// mapped and readable is an error, not a short read.
pub fn read_memory(pid: i32, addr: u64, len: usize) -> io::Result<Vec<u8>> {
    // Not zeroed first: the read fills all of it, or the bytes are not used.
    let mut bytes: Vec<u8> = Vec::with_capacity(len);
    let local = libc::iovec { iov_base: bytes.as_mut_ptr().cast(), iov_len: len };
    let remote = libc::iovec { iov_base: addr as *mut libc::c_void, iov_len: len };
    // SAFETY: `local` describes the `len` bytes `bytes` has room for, which outlive the call
    // and are written only within them; `remote` is an address in the other process, which
    // the kernel checks and only reads.
    let read = unsafe { libc::process_vm_readv(pid, &local, 1, &remote, 1, 0) };
    match usize::try_from(read) {
        Err(_) => Err(io::Error::last_os_error()),
        Ok(read) if read != len => Err(io::Error::new(
            io::ErrorKind::UnexpectedEof,
            format!("{read} of {len} bytes at {addr:#x} of process {pid} readable"),
        )),
        Ok(_) => {
            // SAFETY: the kernel wrote all `len` bytes: they are initialized, within capacity.
            unsafe { bytes.set_len(len) };
            Ok(bytes)
        }
    }
}

/// Bytes under which an allocation comes from the heap rather than a mapping of its own.
const HEAP_ALLOCATIONS_UP_TO: libc::c_int = 32 << 20;
/// Free memory at a heap's top that the allocator keeps rather than handing back at once.
const HEAP_KEPT: libc::c_int = 1 << 30;

/// Keeps memory freed by this process for its next allocations, instead of unmapping it:
/// the allocator then stops mapping, faulting in and zeroing fresh pages for every buffer of
/// a restore's or a dump's (a fetched range of a pack, a decompressed chunk), which took
/// about 15 % of an eager restore's CPU. [`release_freed_memory`] hands what stays free back.
/// glibc's allocator only; elsewhere it does nothing.
pub fn keep_freed_memory() {
    #[cfg(target_env = "gnu")]
    // SAFETY: mallopt only changes the allocator's thresholds; it takes plain integers and
    // is safe to call at any time, from any thread.
    unsafe {
        libc::mallopt(libc::M_MMAP_THRESHOLD, HEAP_ALLOCATIONS_UP_TO);
        libc::mallopt(libc::M_TRIM_THRESHOLD, HEAP_KEPT);
    }
}

/// Hands memory this process freed and kept (see [`keep_freed_memory`]) back to the system.
pub fn release_freed_memory() {
    #[cfg(target_env = "gnu")]
    // SAFETY: malloc_trim takes a plain integer and only returns free pages of the
    // allocator's heaps to the kernel; live allocations are untouched.
    unsafe {
        libc::malloc_trim(0);
    }
}

/// A user's ids: what a check runs with.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Ids {
    pub uid: u32,
    pub gid: u32,
    pub groups: Vec<u32>,
}

/// Runs `work` on a thread of its own that first takes `ids` (its supplementary groups, then
/// its gid, then its uid, and with them loses root's capabilities). The raw system calls
/// change only that thread's credentials, never the rest of stasisd's, and the thread ends
/// with them.
pub fn as_user<T: Send + 'static>(ids: Ids, work: impl FnOnce() -> T + Send + 'static) -> io::Result<T> {
    let thread = std::thread::Builder::new().name("as-user".into()).spawn(move || {
        let (uid, gid) = (ids.uid, ids.gid);
        // SAFETY: setgroups reads `groups.len()` ids from the vector's buffer, which lives for
        // the whole call; setresgid and setresuid take integers. As raw system calls (not
        // glibc's wrappers, which apply them to every thread) they change this thread alone.
        let taken = unsafe {
            libc::syscall(libc::SYS_setgroups, ids.groups.len(), ids.groups.as_ptr()) == 0
                && libc::syscall(libc::SYS_setresgid, gid, gid, gid) == 0
                && libc::syscall(libc::SYS_setresuid, uid, uid, uid) == 0
        };
        taken.then(work).ok_or_else(io::Error::last_os_error)
    })?;
    thread.join().map_err(|_| io::Error::other("the thread checking as another user panicked"))?
}

/// Whether this thread's user may access the file open as `fd` (an `O_PATH` descriptor is
/// enough) for `mode` (`libc::R_OK`, `W_OK`, ...), by its permissions, ACLs included, as
/// `faccessat2(2)` judges with `AT_EMPTY_PATH`.
pub fn may_access(fd: BorrowedFd<'_>, mode: i32) -> io::Result<bool> {
    // SAFETY: the path is a NUL-terminated empty string that outlives the call; the other
    // arguments are integers.
    let r = unsafe {
        libc::syscall(libc::SYS_faccessat2, fd.as_raw_fd(), c"".as_ptr(), mode, libc::AT_EMPTY_PATH)
    };
    match r {
        0 => Ok(true),
        _ => match io::Error::last_os_error() {
            e if e.raw_os_error() == Some(libc::EACCES) || e.raw_os_error() == Some(libc::EPERM) => Ok(false),
            e => Err(e),
        },
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_child_gets_only_the_descriptors_it_is_given() {
        let file = std::fs::File::open("/dev/null").unwrap();
        // dup(2) leaves close-on-exec off: without care the child would inherit both.
        let (stray, kept) = (nix::unistd::dup(&file).unwrap(), nix::unistd::dup(&file).unwrap());
        let (stray, kept) = (stray.as_raw_fd(), kept.as_raw_fd());
        let script = format!("[ ! -e /proc/$$/fd/{stray} ] && [ -e /proc/$$/fd/{kept} ]");
        let mut cmd = Command::new("sh");
        cmd.args(["-c", &script]);
        let mut child = spawn(&mut cmd, ChildSetup { keep_fds: vec![kept], ..Default::default() }).unwrap();
        assert!(child.wait().unwrap().success(), "fd {stray} leaked or fd {kept} was not kept");
    }

    #[test]
    fn every_descriptor_a_message_carries_is_received() {
        use nix::sys::socket::{
            AddressFamily, ControlMessage, MsgFlags, SockFlag, SockType, sendmsg, socketpair,
        };
        use std::os::fd::AsFd;
        let (ours, theirs) =
            socketpair(AddressFamily::Unix, SockType::SeqPacket, None, SockFlag::SOCK_CLOEXEC).unwrap();
        // As many as the guard is sent in one message.
        let files: Vec<std::fs::File> = (0..200).map(|_| std::fs::File::open("/dev/null").unwrap()).collect();
        let raw: Vec<RawFd> = files.iter().map(AsRawFd::as_raw_fd).collect();
        let iov = [std::io::IoSlice::new(b"h")];
        sendmsg::<()>(ours.as_raw_fd(), &iov, &[ControlMessage::ScmRights(&raw)], MsgFlags::empty(), None)
            .unwrap();
        let mut buf = [0u8; 16];
        let (n, fds) = recv_with_fds(theirs.as_fd(), &mut buf).unwrap().expect("a message is waiting");
        assert_eq!((n, fds.len()), (1, 200));
    }

    #[test]
    fn a_process_s_memory_is_read_whole_or_not_at_all() {
        let page = 4096;
        let mut map = memmap2::MmapMut::map_anon(2 * page).unwrap();
        map.iter_mut().enumerate().for_each(|(i, b)| *b = (i / 7) as u8);
        let (addr, pid) = (map.as_ptr() as u64, std::process::id() as i32);
        assert_eq!(read_memory(pid, addr + 100, page).unwrap(), map[100..100 + page]);
        // Past the mapping's end (the page after it is left unmapped here), and nowhere.
        let map_end = addr + 2 * page as u64;
        // SAFETY: MAP_FIXED_NOREPLACE maps the page after the mapping only if nothing is there
        // (it fails rather than replace anything); the probe is unmapped again below.
        let probe = unsafe {
            libc::mmap(
                map_end as *mut libc::c_void,
                page,
                libc::PROT_NONE,
                libc::MAP_PRIVATE | libc::MAP_ANONYMOUS | libc::MAP_FIXED_NOREPLACE,
                -1,
                0,
            )
        };
        if probe as u64 == map_end {
            assert!(read_memory(pid, map_end - 10, 20).is_err(), "a range running into a PROT_NONE page");
            // SAFETY: `probe` is the page mapped just above, used by nothing else.
            unsafe { libc::munmap(probe, page) };
        }
        assert!(read_memory(pid, 8, 16).is_err());
    }
}
