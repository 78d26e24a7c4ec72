//! Mounts beneath a directory of stasisd's own. A restoring CRIU mounts its cgroup yard (a
//! tmpfs, with every cgroup hierarchy mounted under it) in its work directory and unmounts it
//! as it ends; one that is killed leaves the mounts behind, where removing the directory would
//! walk into the host's cgroup hierarchies (and fail on their files).

use std::io;
use std::path::{Path, PathBuf};

use nix::mount::{MntFlags, umount2};

/// Detaches every mount beneath `dir` (not `dir` itself), deepest first; returns how many.
/// A mount that went meanwhile is not an error.
pub fn detach_beneath(dir: &Path) -> io::Result<usize> {
    let points = mount_points_beneath(&std::fs::read_to_string("/proc/self/mountinfo")?, dir);
    for point in &points {
        match umount2(point, MntFlags::MNT_DETACH) {
            Ok(()) | Err(nix::errno::Errno::EINVAL | nix::errno::Errno::ENOENT) => {}
            Err(e) => return Err(io::Error::other(format!("cannot unmount {}: {e}", point.display()))),
        }
    }
    Ok(points.len())
}

/// The mount point a line of /proc/PID/mountinfo names (its fifth field).
pub fn mount_point(line: &str) -> Option<PathBuf> {
    line.split(' ').nth(4).map(|field| PathBuf::from(unescape(field)))
}

/// The mount points of mountinfo `text` that lie beneath `dir`, deepest first.
fn mount_points_beneath(text: &str, dir: &Path) -> Vec<PathBuf> {
    let mut points: Vec<PathBuf> =
        text.lines().filter_map(mount_point).filter(|point| point != dir && point.starts_with(dir)).collect();
    points.sort_by_key(|p| std::cmp::Reverse(p.components().count()));
    points.dedup();
    points
}

/// A mountinfo path field as the path it names: the kernel writes space, tab, newline and
/// backslash as three octal digits after a backslash.
fn unescape(field: &str) -> String {
    let bytes = field.as_bytes();
    let mut out = Vec::with_capacity(bytes.len());
    let mut i = 0;
    while i < bytes.len() {
        let octal = bytes.get(i + 1..i + 4).filter(|d| d.iter().all(|b| (b'0'..=b'7').contains(b)));
        match (bytes[i], octal) {
            (b'\\', Some(d)) => {
                out.push((d[0] - b'0') * 64 + (d[1] - b'0') * 8 + (d[2] - b'0'));
                i += 4;
            }
            (b, _) => {
                out.push(b);
                i += 1;
            }
        }
    }
    String::from_utf8_lossy(&out).into_owned()
}

#[cfg(test)]
mod tests {
    use super::*;

    const MOUNTINFO: &str = "\
22 1 8:1 / / rw,relatime - ext4 /dev/sda1 rw
30 22 0:25 / /dev/shm rw - tmpfs tmpfs rw
41 30 0:40 / /dev/shm/stasis-restore-1/.criu.cgyard.X rw - tmpfs none rw
42 41 0:26 / /dev/shm/stasis-restore-1/.criu.cgyard.X/unified rw - cgroup2 cgroup2 rw
43 41 0:27 / /dev/shm/stasis-restore-1/.criu.cgyard.X/cpu\\040set rw - cgroup cgroup rw,cpuset
44 30 0:41 / /dev/shm/stasis-restore-10/yard rw - tmpfs none rw
";

    #[test]
    fn the_mounts_beneath_a_directory_come_deepest_first() {
        let points = mount_points_beneath(MOUNTINFO, Path::new("/dev/shm/stasis-restore-1"));
        let yard = "/dev/shm/stasis-restore-1/.criu.cgyard.X";
        assert_eq!(points.len(), 3, "{points:?}");
        assert_eq!(points[2], PathBuf::from(yard), "the yard after what is mounted in it");
        assert!(points.contains(&PathBuf::from(format!("{yard}/cpu set"))), "{points:?}");
        assert!(mount_points_beneath(MOUNTINFO, Path::new("/dev/shm")).len() == 4);
        assert!(mount_points_beneath(MOUNTINFO, Path::new("/srv")).is_empty());
    }

    #[test]
    fn octal_escapes_are_undone_and_the_rest_is_kept() {
        assert_eq!(unescape("a\\040b\\011c\\134d"), "a b\tc\\d");
        assert_eq!(unescape("end\\04"), "end\\04");
        assert_eq!(unescape("plain"), "plain");
    }

    #[test]
    fn mounts_left_in_a_directory_are_detached_so_that_it_can_be_removed() {
        if !nix::unistd::geteuid().is_root() {
            eprintln!("skipped: mounting needs root");
            return;
        }
        let dir = tempfile::tempdir().unwrap();
        let yard = dir.path().join("yard");
        std::fs::create_dir(&yard).unwrap();
        let tmpfs = |at: &Path| {
            nix::mount::mount(Some("none"), at, Some("tmpfs"), nix::mount::MsFlags::empty(), None::<&str>)
        };
        tmpfs(&yard).unwrap();
        std::fs::create_dir(yard.join("inner")).unwrap();
        tmpfs(&yard.join("inner")).unwrap();
        std::fs::write(yard.join("inner/file"), b"x").unwrap();
        assert_eq!(detach_beneath(dir.path()).unwrap(), 2);
        assert!(!yard.join("inner").exists(), "the yard's own tmpfs is gone with what it held");
        std::fs::remove_dir_all(dir.path()).unwrap();
        assert_eq!(detach_beneath(dir.path()).unwrap(), 0);
    }
}
