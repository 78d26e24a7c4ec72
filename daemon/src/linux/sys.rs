//! The few operations that need `unsafe`: code that runs in a forked child before `exec`, and
//! mapping a private file.
//!
//! Between `fork` and `exec` only async-signal-safe calls are allowed, so these closures use
//! raw `libc` calls on values prepared beforehand and never allocate.

use std::io;
use std::os::fd::RawFd;
use std::os::unix::process::CommandExt;
use std::process::{Child, Command};

/// What to set up in the child between `fork` and `exec`.
#[derive(Debug, Default, Clone)]
pub struct ChildSetup {
    /// Start a new session (the child becomes session and process-group leader).
    pub new_session: bool,
    /// An open `cgroup.procs` file the child writes itself into.
    pub cgroup_procs: Option<RawFd>,
    /// Descriptors the child keeps across `exec` (their close-on-exec flag is cleared).
    pub keep_fds: Vec<RawFd>,
}

/// Spawns `cmd` with `setup` applied in the child.
pub fn spawn(cmd: &mut Command, setup: ChildSetup) -> io::Result<Child> {
    let ChildSetup { new_session, cgroup_procs, keep_fds } = setup;
    // SAFETY: the closure runs in the forked child before exec. It only calls setsid, write
    // and fcntl (all async-signal-safe) on integers captured by value, and it does not
    // allocate or touch locks shared with the parent.
    unsafe {
        cmd.pre_exec(move || {
            if new_session && libc::setsid() < 0 {
                return Err(io::Error::last_os_error());
            }
            if let Some(fd) = cgroup_procs {
                // "0" names the writing process itself.
                if libc::write(fd, b"0".as_ptr().cast(), 1) < 0 {
                    return Err(io::Error::last_os_error());
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

/// Maps a file that only this process writes, for reading.
///
/// The caller promises the file is private to it (created exclusively, mode 0600, in the
/// daemon's state directory) and no longer written.
pub fn map_private_file(file: &std::fs::File) -> io::Result<memmap2::Mmap> {
    // SAFETY: mapping is unsound only if the file changes while mapped; per this function's
    // contract nobody writes the file any more, so the mapped bytes stay as they are.
    unsafe { memmap2::Mmap::map(file) }
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
