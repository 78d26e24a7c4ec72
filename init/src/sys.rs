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

/// `AUDIT_ARCH_*` of the system calls this build makes (linux/audit.h).
#[cfg(target_arch = "x86_64")]
const AUDIT_ARCH: u32 = 0xc000_003e;
#[cfg(target_arch = "aarch64")]
const AUDIT_ARCH: u32 = 0xc000_00b7;
#[cfg(not(any(target_arch = "x86_64", target_arch = "aarch64")))]
compile_error!("forbid_exec knows the audit architecture of x86_64 and aarch64 only");
/// x86_64's x32 calls carry this bit in their number, under the same architecture.
const X32_SYSCALL_BIT: u32 = 0x4000_0000;

/// Forbids this process and its threads, now and later, to start programs: `execve` and
/// `execveat` fail with EPERM (a seccomp filter; a call of another ABI kills the process).
/// Irrevocable, and also sets no-new-privileges.
pub fn forbid_exec() -> io::Result<()> {
    use libc::{
        BPF_ABS, BPF_JEQ, BPF_JGE, BPF_JMP, BPF_K, BPF_LD, BPF_RET, BPF_W, SECCOMP_RET_ALLOW,
        SECCOMP_RET_ERRNO, SECCOMP_RET_KILL_PROCESS, sock_filter,
    };
    let stmt = |code: u32, k: u32| sock_filter { code: code as u16, jt: 0, jf: 0, k };
    let jump = |k: u32, jt: u8, jf: u8| sock_filter { code: (BPF_JMP | BPF_JEQ | BPF_K) as u16, jt, jf, k };
    let (arch_at, nr_at) =
        (std::mem::offset_of!(libc::seccomp_data, arch), std::mem::offset_of!(libc::seccomp_data, nr));
    let filter = [
        stmt(BPF_LD | BPF_W | BPF_ABS, arch_at as u32),
        jump(AUDIT_ARCH, 0, 6),
        stmt(BPF_LD | BPF_W | BPF_ABS, nr_at as u32),
        sock_filter { code: (BPF_JMP | BPF_JGE | BPF_K) as u16, jt: 4, jf: 0, k: X32_SYSCALL_BIT },
        jump(libc::SYS_execve as u32, 1, 0),
        jump(libc::SYS_execveat as u32, 0, 1),
        stmt(BPF_RET | BPF_K, SECCOMP_RET_ERRNO | libc::EPERM as u32),
        stmt(BPF_RET | BPF_K, SECCOMP_RET_ALLOW),
        stmt(BPF_RET | BPF_K, SECCOMP_RET_KILL_PROCESS),
    ];
    let program = libc::sock_fprog { len: filter.len() as u16, filter: filter.as_ptr().cast_mut() };
    // SAFETY: PR_SET_NO_NEW_PRIVS takes plain integers and touches no memory.
    if unsafe { libc::prctl(libc::PR_SET_NO_NEW_PRIVS, 1, 0, 0, 0) } != 0 {
        return Err(io::Error::last_os_error());
    }
    // SAFETY: `program` points at `filter`, which outlives the call; the kernel copies it.
    let set = unsafe {
        libc::syscall(
            libc::SYS_seccomp,
            libc::SECCOMP_SET_MODE_FILTER,
            libc::SECCOMP_FILTER_FLAG_TSYNC,
            &raw const program,
        )
    };
    match set {
        0 => Ok(()),
        -1 => Err(io::Error::last_os_error()),
        thread => Err(io::Error::other(format!("thread {thread} could not take the filter"))),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_process_forbidden_to_exec_cannot_start_a_program() {
        // In a child, so that this test process keeps its freedom: the filter is installed
        // between fork and exec, and the exec is what it refuses.
        let mut cmd = std::process::Command::new("/bin/true");
        use std::os::unix::process::CommandExt;
        // SAFETY: the closure runs in the forked child before exec; it calls prctl and
        // seccomp only (forbid_exec allocates nothing before them but the filter on the stack).
        unsafe { cmd.pre_exec(forbid_exec) };
        let err = cmd.status().expect_err("the exec is refused");
        assert_eq!(err.raw_os_error(), Some(libc::EPERM), "{err}");
    }
}
