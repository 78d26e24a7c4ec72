//! The system calls the init programs make without a safe wrapper: stasis-init's own fork,
//! taking ownership of the descriptor it reports on, and stasis-pod's new session for its
//! workload.

use std::io;
use std::os::fd::{FromRawFd, OwnedFd, RawFd};

/// Which side of a [`fork`] this is.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Forked {
    /// The parent, with the child's pid.
    Parent(i32),
    Child,
}

/// Forks this process. Only for single-threaded programs (`stasis-init`): the child of a
/// multi-threaded one may only make async-signal-safe calls.
pub fn fork() -> io::Result<Forked> {
    // SAFETY: callers are single-threaded (see above), so the child inherits no lock held by
    // another thread and may go on as a normal process.
    match unsafe { libc::fork() } {
        -1 => Err(io::Error::last_os_error()),
        0 => Ok(Forked::Child),
        child => Ok(Forked::Parent(child)),
    }
}

/// Takes ownership of descriptor `fd`, inherited from the starting process for this one
/// alone; an error if it is not open.
pub fn take_inherited_fd(fd: RawFd) -> io::Result<OwnedFd> {
    // SAFETY: F_GETFD reads the flags of a descriptor number and touches no memory.
    if unsafe { libc::fcntl(fd, libc::F_GETFD) } < 0 {
        return Err(io::Error::last_os_error());
    }
    // SAFETY: the descriptor is open (checked above) and, by the caller's contract, owned by
    // nothing else in this process, so this is its only owner.
    Ok(unsafe { OwnedFd::from_raw_fd(fd) })
}

/// Has the process `cmd` starts lead a session of its own (setsid between fork and exec).
pub fn own_session(cmd: &mut std::process::Command) {
    use std::os::unix::process::CommandExt;
    // SAFETY: the closure runs in the forked child before exec and calls only setsid, which is
    // async-signal-safe, touching no memory shared with the parent.
    unsafe {
        cmd.pre_exec(|| match libc::setsid() {
            -1 => Err(io::Error::last_os_error()),
            _ => Ok(()),
        })
    };
}
