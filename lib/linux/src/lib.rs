//! Linux boundaries: /proc inspection, process spawning, cgroups, signals and child reaping.
//!
//! Its unsafe code lives in [`sys`] and, for userfaultfd's ioctls, [`uffd`].

#![deny(unsafe_code)]

pub mod cgroup;
pub mod cloud;
pub mod container;
pub mod durable_file;
pub mod fdinfo;
pub mod init_program;
pub mod iptables;
pub mod mounts;
pub mod net;
pub mod netlink;
pub mod nft;
pub mod owner_access;
pub mod port_watch;
pub mod private_dir;
pub mod proc;
pub mod pty;
pub mod reaper;
pub mod sock_diag;
pub mod syn_hold;
#[allow(unsafe_code)]
pub mod sys;
#[allow(unsafe_code)]
pub mod uffd;

/// A program installed next to this one (stasisd's helpers: `stasis-lazy-guard`,
/// `stasis-init`).
pub fn companion_program(name: &str) -> std::io::Result<std::path::PathBuf> {
    std::env::current_exe().map(|exe| exe.with_file_name(name))
}

/// Whether `path` lies on a tmpfs (memory that a reboot clears).
pub fn on_tmpfs(path: &std::path::Path) -> std::io::Result<bool> {
    let fs = nix::sys::statfs::statfs(path)?;
    Ok(fs.filesystem_type() == nix::sys::statfs::TMPFS_MAGIC)
}

/// The first file named `name` in a directory of `PATH`, as a shell would find the program.
pub fn find_program(name: &str) -> Option<std::path::PathBuf> {
    let paths = std::env::var_os("PATH")?;
    std::env::split_paths(&paths).map(|dir| dir.join(name)).find(|p| p.is_file())
}

#[cfg(test)]
mod tests {
    use std::collections::HashMap;
    use std::path::Path;

    #[test]
    fn on_tmpfs_agrees_with_the_mount_table() {
        let mounts = std::fs::read_to_string("/proc/self/mounts").unwrap();
        // Each mount point's filesystem: the last mounted there is what a path reaches now.
        let kinds: HashMap<&str, &str> = mounts
            .lines()
            .filter_map(|l| {
                let mut fields = l.split(' ');
                Some((fields.nth(1)?, fields.next()?))
            })
            .collect();
        // Names with spaces and the like are escaped in the table; they are left out.
        for (point, _) in kinds.iter().filter(|(p, kind)| **kind == "tmpfs" && !p.contains('\\')) {
            assert!(super::on_tmpfs(Path::new(point)).unwrap(), "{point} is a tmpfs");
        }
        assert!(!super::on_tmpfs(Path::new("/proc")).unwrap());
        assert!(super::on_tmpfs(Path::new("/no/such/path")).is_err());
    }
}
