//! `libstasis_enter_root.so`: what the pod bundle's loader preloads into the CRIU that stasisd
//! runs in a Kubernetes container (`stasis_criu::Enter`).
//!
//! stasisd starts that CRIU in the container's namespaces but with the pod bundle's directory
//! as its root, so that the loader and every library it loads are the bundle's: the image's
//! `/etc/ld.so.preload` and libraries, which would otherwise run as root in CRIU, are out of
//! its reach. Once the loader is done, this library's constructor moves the process into the
//! container's root (the directory open as descriptor `STASIS_ENTER_ROOT_FD`, which stasisd
//! passes), where CRIU then finds the tree's files and the container's /proc, and closes the
//! descriptor. Should it not run (the loader ignores a preload it cannot load), CRIU stays in
//! the bundle, where there is no /proc, and fails at once rather than dump anything.
//!
//! If the descriptor is named but the move fails, the process exits (status 127) before CRIU
//! starts.

use std::os::fd::{AsRawFd, FromRawFd, OwnedFd};

/// The variable naming the descriptor of the root to enter.
const ROOT_FD: &str = "STASIS_ENTER_ROOT_FD";

/// Enters the root directory open as descriptor `fd`.
fn enter(fd: OwnedFd) -> std::io::Result<()> {
    // SAFETY: fchdir only reads the descriptor's number; `fd` is open and ours.
    if unsafe { libc::fchdir(fd.as_raw_fd()) } != 0 {
        return Err(std::io::Error::last_os_error());
    }
    drop(fd);
    std::os::unix::fs::chroot(".")?;
    std::env::set_current_dir("/")
}

/// The constructor's work: enter the root if one is named.
fn on_load() {
    let Some(fd) = std::env::var(ROOT_FD).ok().and_then(|v| v.parse::<i32>().ok()) else { return };
    if fd < 3 {
        eprintln!("{ROOT_FD}={fd} is not a descriptor stasisd passes");
        std::process::exit(127);
    }
    // SAFETY: stasisd passes this descriptor for this library alone, and nothing else of the
    // process has seen it yet (constructors run before main), so it is ours to own and close.
    let fd = unsafe { OwnedFd::from_raw_fd(fd) };
    if let Err(e) = enter(fd) {
        eprintln!("entering the container's root: {e}");
        std::process::exit(127);
    }
}

/// Runs [`on_load`] when the loader initialises this library, before CRIU's `main`.
// SAFETY: an `.init_array` entry is a plain function pointer the loader calls once with no
// arguments; `on_load` takes none and unwinds nowhere (it exits on error).
#[used]
#[unsafe(link_section = ".init_array")]
static ON_LOAD: extern "C" fn() = {
    extern "C" fn run() {
        on_load();
    }
    run
};
