//! Directories that are stasisd's alone: the state directory and a local store hold the memory
//! of every checkpointed process, so nobody but their owner may even look into them.

use std::fs;
use std::io;
use std::os::unix::fs::{DirBuilderExt, MetadataExt, OpenOptionsExt, PermissionsExt};
use std::path::Path;

use tracing::warn;

/// Makes `dir` (and any missing parent) if needed, and sees that it is a directory of this
/// process's user that nobody else may enter: a looser mode is tightened to 0700, with a
/// warning; a directory of another user is refused, because its owner could read or replace
/// what stasisd keeps there, and so is a symbolic link (whoever made it could point it
/// elsewhere, or at a directory whose mode must not change). The directory is checked and
/// changed through one descriptor opened without following links, so it cannot be swapped in
/// between.
pub fn ensure_private_dir(dir: &Path) -> io::Result<()> {
    fs::DirBuilder::new().recursive(true).mode(0o700).create(dir)?;
    if fs::symlink_metadata(dir)?.file_type().is_symlink() {
        return Err(io::Error::other(format!(
            "{} is a symbolic link; name the directory itself",
            dir.display()
        )));
    }
    // A link put in its place since is not followed either: the open fails.
    let opened = fs::OpenOptions::new()
        .read(true)
        .custom_flags(libc::O_DIRECTORY | libc::O_NOFOLLOW)
        .open(dir)
        .map_err(|e| match e.raw_os_error() {
            Some(libc::ELOOP | libc::ENOTDIR) => {
                io::Error::other(format!("{} is not a directory (or was just replaced)", dir.display()))
            }
            _ => e,
        })?;
    let meta = opened.metadata()?;
    let me = nix::unistd::geteuid().as_raw();
    if meta.uid() != me {
        return Err(io::Error::other(format!(
            "{} belongs to uid {}, not to stasisd's uid {me}: give it to {me} (chown) and make it mode 0700",
            dir.display(),
            meta.uid()
        )));
    }
    let mode = meta.mode() & 0o7777;
    if mode & 0o077 != 0 {
        opened.set_permissions(fs::Permissions::from_mode(0o700))?;
        warn!(dir = %dir.display(), was = format!("{mode:o}"), "others could read or enter a directory of stasisd's; it is mode 0700 now");
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn new_and_loose_directories_end_up_0700() {
        let tmp = tempfile::tempdir().unwrap();
        let fresh = tmp.path().join("a/b");
        ensure_private_dir(&fresh).unwrap();
        assert_eq!(fs::metadata(&fresh).unwrap().mode() & 0o7777, 0o700);
        let loose = tmp.path().join("loose");
        fs::create_dir(&loose).unwrap();
        fs::set_permissions(&loose, fs::Permissions::from_mode(0o755)).unwrap();
        ensure_private_dir(&loose).unwrap();
        assert_eq!(fs::metadata(&loose).unwrap().mode() & 0o7777, 0o700);
    }

    #[test]
    fn a_file_is_refused() {
        let tmp = tempfile::tempdir().unwrap();
        let file = tmp.path().join("f");
        fs::write(&file, b"x").unwrap();
        assert!(ensure_private_dir(&file).is_err());
    }

    #[test]
    fn a_symbolic_link_is_refused_and_its_target_left_alone() {
        let tmp = tempfile::tempdir().unwrap();
        let target = tmp.path().join("target");
        fs::create_dir(&target).unwrap();
        fs::set_permissions(&target, fs::Permissions::from_mode(0o755)).unwrap();
        let link = tmp.path().join("link");
        std::os::unix::fs::symlink(&target, &link).unwrap();
        let err = ensure_private_dir(&link).unwrap_err().to_string();
        assert!(err.contains("symbolic link"), "{err}");
        assert_eq!(fs::metadata(&target).unwrap().mode() & 0o7777, 0o755);
    }

    #[test]
    fn another_users_directory_is_refused() {
        if !nix::unistd::geteuid().is_root() {
            return;
        }
        let tmp = tempfile::tempdir().unwrap();
        let theirs = tmp.path().join("theirs");
        fs::create_dir(&theirs).unwrap();
        std::os::unix::fs::chown(&theirs, Some(65534), None).unwrap();
        let err = ensure_private_dir(&theirs).unwrap_err().to_string();
        assert!(err.contains("belongs to uid 65534"), "{err}");
    }
}
