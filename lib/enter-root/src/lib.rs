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
//!
//! It also keeps CRIU from the container's cache of kernel facts: CRIU loads `/run/criu.kdat`
//! of whatever root it runs in, checking only its size and two magic numbers, and saves one there
//! when it probed the kernel itself. In a container's root that file is the image's to write, so
//! an image could hand a root CRIU kernel facts of its choosing (feature flags, the zero page's
//! frame, sizes). This library answers CRIU's opens of that file (and of the temporary file it
//! saves through) as if it did not exist: CRIU probes the kernel on every run and leaves the
//! container's `/run` alone.

use std::ffi::{CStr, c_char, c_int, c_uint};
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

/// CRIU's cache of kernel facts (`KERNDAT_CACHE_FILE`); it saves through this name with `.tmp`
/// added.
const KERNEL_FACTS: &[u8] = b"/run/criu.kdat";

/// Whether `path` names CRIU's cache of kernel facts or the file it saves it through.
fn is_kernel_facts(path: &CStr) -> bool {
    let path = path.to_bytes();
    path.strip_prefix(KERNEL_FACTS).is_some_and(|rest| rest.is_empty() || rest == b".tmp")
}

/// `open(2)` as CRIU calls it, except for the cache of kernel facts, which does not exist here.
///
/// # Safety
///
/// `path` is null or a C string, as for `open(2)`.
unsafe fn open_here(path: *const c_char, flags: c_int, mode: c_uint) -> c_int {
    // SAFETY: the caller passes `path` as it would to open(2): a C string when not null.
    if !path.is_null() && is_kernel_facts(unsafe { CStr::from_ptr(path) }) {
        // SAFETY: __errno_location returns this thread's errno, valid for the thread's life.
        unsafe { *libc::__errno_location() = libc::ENOENT };
        return -1;
    }
    // SAFETY: openat reads `path` (checked by the kernel) and takes the other arguments as
    // numbers; the mode is ignored unless `flags` creates a file, as with open(2).
    unsafe { libc::syscall(libc::SYS_openat, libc::AT_FDCWD, path, flags, mode) as c_int }
}

/// Replaces the C library's `open` in CRIU. Declared with the mode as a fixed argument: on the
/// Linux ABIs stasis runs on (x86-64, AArch64) a variadic caller passes it in the same register.
///
/// # Safety
///
/// As for `open(2)`.
#[unsafe(no_mangle)]
pub unsafe extern "C" fn open(path: *const c_char, flags: c_int, mode: c_uint) -> c_int {
    // SAFETY: passed on as the caller gave it.
    unsafe { open_here(path, flags, mode) }
}

/// Replaces the C library's `open64` (what CRIU, built with 64-bit file offsets, calls).
///
/// # Safety
///
/// As for `open(2)`.
#[unsafe(no_mangle)]
pub unsafe extern "C" fn open64(path: *const c_char, flags: c_int, mode: c_uint) -> c_int {
    // SAFETY: passed on as the caller gave it.
    unsafe { open_here(path, flags, mode) }
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

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn only_the_cache_and_its_temporary_file_are_hidden() {
        assert!(is_kernel_facts(c"/run/criu.kdat"));
        assert!(is_kernel_facts(c"/run/criu.kdat.tmp"));
        assert!(!is_kernel_facts(c"/run/criu.kdat.old"));
        assert!(!is_kernel_facts(c"/run/criu"));
        assert!(!is_kernel_facts(c"/proc/self/maps"));
    }

    #[test]
    fn other_files_open_as_usual_and_the_cache_does_not() {
        let dir = std::env::temp_dir().join(format!("enter-root-{}", std::process::id()));
        std::fs::create_dir_all(&dir).unwrap();
        let file = dir.join("f");
        std::fs::write(&file, b"x").unwrap();
        let name = std::ffi::CString::new(file.as_os_str().as_encoded_bytes()).unwrap();
        // SAFETY: a C string and plain flags.
        let fd = unsafe { open64(name.as_ptr(), libc::O_RDONLY | libc::O_CLOEXEC, 0) };
        assert!(fd >= 0, "{}", std::io::Error::last_os_error());
        // SAFETY: `fd` was just opened here and is closed once.
        drop(unsafe { OwnedFd::from_raw_fd(fd) });
        // SAFETY: a C string and plain flags.
        let fd = unsafe { open(c"/run/criu.kdat".as_ptr(), libc::O_RDONLY, 0) };
        assert_eq!(fd, -1);
        assert_eq!(std::io::Error::last_os_error().raw_os_error(), Some(libc::ENOENT));
        std::fs::remove_dir_all(&dir).unwrap();
    }
}
