//! What CRIU's code injected into a pid namespace's init leaves in the init's working
//! directory: to read the init's cgroups it makes a directory there and mounts a /proc of the
//! namespace on it, then unmounts and removes it. A CRIU killed in between leaves both behind,
//! and every later dump of that init would fail to make the directory.

use std::io;
use std::path::Path;

use nix::mount::{MntFlags, umount2};

/// The directory CRIU's injected code mounts /proc on, relative to the init's working
/// directory.
const PROC_MOUNTPOINT: &str = "proc.crtools";

/// Removes what a CRIU killed mid-dump left in `init_dir` (the /proc mount, detached, and
/// its directory); nothing else there is touched.
pub fn clear_leftovers(init_dir: &Path) -> io::Result<()> {
    let mountpoint = init_dir.join(PROC_MOUNTPOINT);
    match std::fs::remove_dir(&mountpoint) {
        Err(e) if e.raw_os_error() == Some(libc::EBUSY) => {
            umount2(&mountpoint, MntFlags::MNT_DETACH)?;
            std::fs::remove_dir(&mountpoint)
        }
        Err(e) if e.kind() == io::ErrorKind::NotFound => Ok(()),
        other => other,
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_left_directory_goes_and_other_files_stay() {
        let dir = tempfile::tempdir().unwrap();
        std::fs::create_dir(dir.path().join(PROC_MOUNTPOINT)).unwrap();
        std::fs::write(dir.path().join("keep"), b"x").unwrap();
        clear_leftovers(dir.path()).unwrap();
        assert!(!dir.path().join(PROC_MOUNTPOINT).exists());
        assert!(dir.path().join("keep").exists());
        clear_leftovers(dir.path()).unwrap();
    }
}
