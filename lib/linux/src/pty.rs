//! Terminals for restored jobs: a job checkpointed from an interactive terminal gets a new
//! pseudo-terminal on restore, whose output stasisd appends to the workload's log.

use std::fs::{File, OpenOptions};
use std::io::{self, Read, Write};
use std::os::fd::OwnedFd;
use std::os::unix::fs::{MetadataExt, OpenOptionsExt};
use std::path::{Path, PathBuf};

use tracing::debug;

/// CRIU's key for the terminal device at `path` (`tty[<rdev>:<dev>]`, hex), if it is a
/// pseudo-terminal slave.
pub fn tty_key(path: &Path) -> Option<String> {
    if !path.to_str()?.starts_with("/dev/pts/") {
        return None;
    }
    let meta = std::fs::metadata(path).ok()?;
    Some(format!("tty[{:x}:{:x}]", meta.rdev(), meta.dev()))
}

/// Whether `key` names a terminal in CRIU's external-resource syntax.
pub fn is_tty_key(key: &str) -> bool {
    key.starts_with("tty[")
}

/// Opens a new pseudo-terminal and copies everything written to it into `log` (appending)
/// until the last process holding the terminal closes it. Returns the slave side, to be handed
/// to the restored tree.
pub fn terminal_to_log(log: &Path) -> io::Result<OwnedFd> {
    let pty = nix::pty::openpty(None, None).map_err(io::Error::from)?;
    let out = OpenOptions::new().create(true).append(true).mode(0o600).open(log)?;
    let master = File::from(pty.master);
    let log: PathBuf = log.to_path_buf();
    std::thread::Builder::new().name("stasis-pty".into()).spawn(move || pump(master, out, &log))?;
    Ok(pty.slave)
}

fn pump(mut master: File, mut out: File, log: &Path) {
    let mut buf = [0u8; 8192];
    loop {
        match master.read(&mut buf) {
            Ok(0) => break,
            Ok(n) => {
                if out.write_all(&buf[..n]).is_err() {
                    break;
                }
            }
            Err(e) if e.kind() == io::ErrorKind::Interrupted => continue,
            // EIO: every slave descriptor is closed, the job is gone.
            Err(_) => break,
        }
    }
    debug!(log = %log.display(), "terminal closed");
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn terminal_output_lands_in_the_log() {
        let dir = tempfile::tempdir().unwrap();
        let log = dir.path().join("w.log");
        let slave = terminal_to_log(&log).unwrap();
        let mut tty = File::from(slave);
        let path =
            std::fs::read_link(format!("/proc/self/fd/{}", std::os::fd::AsRawFd::as_raw_fd(&tty))).unwrap();
        assert!(tty_key(&path).is_some_and(|k| is_tty_key(&k)), "{path:?}");
        tty.write_all(b"hello\n").unwrap();
        drop(tty);
        let text = (0..100)
            .find_map(|_| {
                std::thread::sleep(std::time::Duration::from_millis(10));
                std::fs::read_to_string(&log).ok().filter(|t| t.contains("hello"))
            })
            .expect("terminal output reached the log");
        assert!(text.starts_with("hello"));
        assert_eq!(tty_key(Path::new("/dev/null")), None);
    }
}
