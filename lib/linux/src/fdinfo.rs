//! What `/proc/PID/fdinfo/N` tells of one open descriptor beyond its path: the locks held
//! through it (every kind: POSIX, flock and open-file-description locks, which `/proc/locks`
//! shows with pid -1), for a pseudo-terminal master, the index of its slave, and its open
//! flags.

use std::fs;
use std::io;

/// The parts of a descriptor's fdinfo stasis uses.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct FdInfo {
    /// Whether a lock is held through this descriptor.
    pub holds_lock: bool,
    /// For a pseudo-terminal master (`/dev/ptmx`): its slave's number (`/dev/pts/N`).
    pub tty_index: Option<u32>,
    /// The descriptor's open flags (`O_RDWR`, `O_PATH`, ...).
    pub flags: Option<i32>,
}

impl FdInfo {
    /// Reads descriptor `fd` of process `pid`.
    pub fn read(pid: i32, fd: i32) -> io::Result<FdInfo> {
        Ok(FdInfo::parse(&fs::read_to_string(format!("/proc/{pid}/fdinfo/{fd}"))?))
    }

    /// Parses fdinfo text: `lock:\t1: OFDLCK ADVISORY WRITE -1 08:01:12 0 EOF` lines, and
    /// `tty-index:\t3`.
    pub fn parse(text: &str) -> FdInfo {
        let mut info = FdInfo::default();
        for line in text.lines() {
            let Some((key, value)) = line.split_once(':') else { continue };
            match key {
                "lock" => info.holds_lock |= !value.contains("->"), // "->": waiting for it
                "tty-index" => info.tty_index = value.trim().parse().ok(),
                "flags" => info.flags = i32::from_str_radix(value.trim(), 8).ok(),
                _ => {}
            }
        }
        info
    }
}

/// Whether `path` names the pseudo-terminal multiplexer (a master's path).
pub fn is_pty_master(path: &str) -> bool {
    path == "/dev/ptmx" || path == "/dev/pts/ptmx"
}

/// The number of pseudo-terminal slave `path` (`/dev/pts/N`).
pub fn pty_slave_index(path: &str) -> Option<u32> {
    path.strip_prefix("/dev/pts/")?.parse().ok()
}

#[cfg(test)]
mod tests {
    use std::os::fd::AsRawFd;

    use super::*;

    #[test]
    fn locks_of_every_kind_a_masters_index_and_the_flags_are_read() {
        let ofd = "pos:\t0\nflags:\t02\nmnt_id:\t30\nino:\t12\nlock:\t1: OFDLCK  ADVISORY  WRITE -1 08:01:12 0 EOF\n";
        assert_eq!(FdInfo::parse(ofd), FdInfo { holds_lock: true, tty_index: None, flags: Some(2) });
        let waiting = "pos:\t0\nlock:\t1: -> FLOCK  ADVISORY  WRITE 77 08:01:12 0 EOF\n";
        assert!(!FdInfo::parse(waiting).holds_lock);
        let master = "pos:\t0\nflags:\t0100002\nmnt_id:\t25\nino:\t2\ntty-index:\t7\n";
        assert_eq!(
            FdInfo::parse(master),
            FdInfo { holds_lock: false, tty_index: Some(7), flags: Some(0o100002) }
        );
        assert_eq!(pty_slave_index("/dev/pts/12"), Some(12));
        assert_eq!(pty_slave_index("/dev/pts/ptmx"), None);
        assert!(is_pty_master("/dev/ptmx") && !is_pty_master("/dev/pts/0"));
    }

    #[test]
    fn an_open_file_description_lock_of_this_process_is_seen() {
        let file = tempfile::tempfile().unwrap();
        let fd = file.as_raw_fd();
        let me = std::process::id() as i32;
        assert!(!FdInfo::read(me, fd).unwrap().holds_lock);
        let lock = libc::flock { l_type: libc::F_WRLCK as _, l_whence: 0, l_start: 0, l_len: 0, l_pid: 0 };
        nix::fcntl::fcntl(&file, nix::fcntl::FcntlArg::F_OFD_SETLK(&lock)).unwrap();
        assert!(FdInfo::read(me, fd).unwrap().holds_lock);
    }
}
