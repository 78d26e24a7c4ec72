//! A size-limited tmpfs mounted over a directory for a test's duration: a disk that fills up,
//! or that can be made read-only.

use std::path::{Path, PathBuf};

use nix::mount::{MntFlags, MsFlags, mount, umount2};

pub struct SmallDisk(PathBuf);

impl SmallDisk {
    pub fn mount(at: &Path, mib: u64) -> SmallDisk {
        std::fs::create_dir_all(at).expect("mount point");
        let options = format!("size={mib}m,mode=0700");
        mount(Some("tmpfs"), at, Some("tmpfs"), MsFlags::empty(), Some(options.as_str()))
            .unwrap_or_else(|e| panic!("mounting a {mib} MiB tmpfs on {}: {e}", at.display()));
        SmallDisk(at.to_path_buf())
    }

    pub fn used_bytes(&self) -> u64 {
        let stat = nix::sys::statvfs::statvfs(&self.0).expect("statvfs");
        (stat.blocks() - stat.blocks_free()) * stat.fragment_size()
    }

    pub fn read_only(&self) {
        mount(None::<&str>, &self.0, None::<&str>, MsFlags::MS_REMOUNT | MsFlags::MS_RDONLY, None::<&str>)
            .unwrap_or_else(|e| panic!("remounting {} read-only: {e}", self.0.display()));
    }
}

impl Drop for SmallDisk {
    fn drop(&mut self) {
        let _ = umount2(&self.0, MntFlags::MNT_DETACH);
    }
}
