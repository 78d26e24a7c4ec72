//! The `stasis-init` a workload's pid namespace runs, kept by its content. CRIU restores a
//! process only where its executable is the same file it was, so a tree dumped under one
//! release's stasis-init would not restore after an upgrade, nor on a node with another
//! release. Each build of stasis-init is therefore installed under a name of its own hash in
//! [`INIT_PROGRAMS`] (the same path on every node), runs from there, travels with every
//! checkpoint of a tree it heads (as a file among the images, deduplicated like any), and is
//! put back in place by a restore that finds it missing.

use std::fs;
use std::io::{self, Write};
use std::os::unix::fs::{OpenOptionsExt, PermissionsExt};
use std::path::{Path, PathBuf};

/// Where the builds of stasis-init are installed.
pub const INIT_PROGRAMS: &str = "/var/lib/stasis/init";
/// The file-name prefix of an installed build.
const PREFIX: &str = "stasis-init-";

/// Installs this release's stasis-init (next to stasisd) by its content, if not there yet;
/// returns where it is.
pub fn install() -> io::Result<PathBuf> {
    let program = fs::read(super::companion_program("stasis-init")?)?;
    let name = format!("{PREFIX}{}", &blake3::hash(&program).to_hex()[..16]);
    put(Path::new(INIT_PROGRAMS), &name, &program)
}

/// Whether `exe` is an installed stasis-init.
pub fn is_installed(exe: &Path) -> bool {
    exe.parent() == Some(Path::new(INIT_PROGRAMS)) && name_of(exe).is_some()
}

/// The name under which an installed build `exe` travels in a checkpoint's images.
pub fn name_of(exe: &Path) -> Option<&str> {
    exe.file_name()?.to_str().filter(|n| n.starts_with(PREFIX) && n.len() > PREFIX.len())
}

/// Installs each build of stasis-init that the images in `images` carry and that this node
/// lacks.
pub fn install_from(images: &Path) -> io::Result<()> {
    for entry in fs::read_dir(images)?.flatten() {
        let name = entry.file_name().to_string_lossy().into_owned();
        if name_of(Path::new(&name)).is_some() && !Path::new(INIT_PROGRAMS).join(&name).exists() {
            put(Path::new(INIT_PROGRAMS), &name, &fs::read(entry.path())?)?;
        }
    }
    Ok(())
}

/// Writes `program` as executable `dir/name` (atomically) unless a file of its size is there.
fn put(dir: &Path, name: &str, program: &[u8]) -> io::Result<PathBuf> {
    let path = dir.join(name);
    if fs::metadata(&path).is_ok_and(|m| m.len() == program.len() as u64) {
        return Ok(path);
    }
    fs::create_dir_all(dir)?;
    let partial = dir.join(format!(".{name}.{}", std::process::id()));
    let mut file = fs::File::options().write(true).create(true).truncate(true).mode(0o755).open(&partial)?;
    file.write_all(program)?;
    file.sync_all()?;
    fs::set_permissions(&partial, fs::Permissions::from_mode(0o755))?;
    fs::rename(&partial, &path)?;
    Ok(path)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_carried_build_is_put_in_place_once() {
        let (images, dir) = (tempfile::tempdir().unwrap(), tempfile::tempdir().unwrap());
        let path = put(dir.path(), "stasis-init-0123456789abcdef", b"program").unwrap();
        assert_eq!(fs::read(&path).unwrap(), b"program");
        assert_eq!(fs::metadata(&path).unwrap().permissions().mode() & 0o777, 0o755);
        assert_eq!(put(dir.path(), "stasis-init-0123456789abcdef", b"program").unwrap(), path);
        assert!(name_of(Path::new("/x/stasis-init-0123")).is_some());
        assert!(
            name_of(Path::new("/x/stasis-init-")).is_none() && name_of(Path::new("/x/core-1.img")).is_none()
        );
        fs::write(images.path().join("core-1.img"), b"image").unwrap();
        assert!(install_from(images.path()).is_ok());
    }
}
