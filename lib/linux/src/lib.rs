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

/// The first file named `name` in a directory of `PATH`, as a shell would find the program.
pub fn find_program(name: &str) -> Option<std::path::PathBuf> {
    let paths = std::env::var_os("PATH")?;
    std::env::split_paths(&paths).map(|dir| dir.join(name)).find(|p| p.is_file())
}
