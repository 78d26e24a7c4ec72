//! A stand-in for NVIDIA's driver library, built as `libcuda.so.1`'s replacement for tests on
//! machines without a GPU: what stasis calls of the driver, and what a CUDA program calls to
//! have a context.
//!
//! - The checkpoint API moves each process through the driver's states (running, locked,
//!   checkpointed) and refuses a call from the wrong state, as the driver does. The states
//!   are kept in files, one per pid, in the directory `states` beside the library's file, so
//!   that every process loading the library (the program, stasisd, a helper in a container)
//!   sees the same ones; a test shares the directory with the containers it runs. It is
//!   opened at the first call and reached through its descriptor, so that a caller that
//!   changes its root directory afterwards (stasis' helper does) still finds it. The pids
//!   are those of the caller's pid namespace, as the driver's are.
//! - Every checkpoint call is logged to `states/calls` with the pid and mount namespaces and
//!   the root directory (device and inode) of the process that made it: a test can tell
//!   where the call was made.
//! - A `cuInit` after a change of root runs a program a test names (see [`run_on_init`]).
//! - The GPUs are the `/dev/nvidiaN` files the caller sees (none need work: nothing opens
//!   them), so a container sees those it was given.
//! - A program's `cuCtxCreate_v2` makes it a CUDA process (running); its
//!   `cuCtxSynchronize` waits while it is locked or checkpointed, as its GPU calls would.
//!
//! No device memory is emulated. The C entry points are in [`ffi`].

mod ffi;

use std::fs::{self, File};
use std::io::Write;
use std::os::fd::AsRawFd;
use std::path::{Path, PathBuf};
use std::sync::OnceLock;
use std::time::Duration;

/// `CUresult` codes it answers.
const SUCCESS: u32 = 0;
const NOT_INITIALIZED: u32 = 3;
const INVALID_DEVICE: u32 = 101;
const OPERATING_SYSTEM: u32 = 304;
const ILLEGAL_STATE: u32 = 401;

/// `CUprocessState` values.
const RUNNING: i32 = 0;
const LOCKED: i32 = 1;
const CHECKPOINTED: i32 = 2;

/// The file of this library, as the process's maps name it.
fn own_file() -> Option<PathBuf> {
    let here = own_file as *const () as usize;
    let maps = fs::read_to_string("/proc/self/maps").ok()?;
    maps.lines().find_map(|line| {
        let (range, rest) = line.split_once(' ')?;
        let (start, end) = range.split_once('-')?;
        let (start, end) = (usize::from_str_radix(start, 16).ok()?, usize::from_str_radix(end, 16).ok()?);
        let path = rest.splitn(5, ' ').nth(4)?.trim_start();
        (start <= here && here < end).then(|| PathBuf::from(path))
    })
}

/// The directory of states (made if need be) as a path through its open descriptor, and the
/// caller's root directory (device and inode) when it was opened.
fn states() -> Option<&'static (File, PathBuf, String)> {
    static DIR: OnceLock<Option<(File, PathBuf, String)>> = OnceLock::new();
    let open = || {
        let dir = own_file()?.parent()?.join("states");
        fs::create_dir_all(&dir).ok()?;
        let file = File::open(&dir).ok()?;
        let path = PathBuf::from(format!("/proc/self/fd/{}", file.as_raw_fd()));
        Some((file, path, root()))
    };
    DIR.get_or_init(open).as_ref()
}

/// The directory of states, as a path through its open descriptor.
fn state_dir() -> &'static Path {
    states().map_or(Path::new("/nonexistent/stasis-fake-cuda"), |(_, path, _)| path)
}

/// The caller's root directory, as `device:inode`.
fn root() -> String {
    use std::os::unix::fs::MetadataExt;
    fs::metadata("/").map(|m| format!("{}:{}", m.dev(), m.ino())).unwrap_or_default()
}

/// What `cuInit` does in a caller that changed its root since it loaded the library (stasis'
/// helper in a container): as the real driver starts `nvidia-modprobe` to make device files
/// it misses, it starts the program named in `states/init-runs`, if any (a path in the new
/// root), and appends how that went to `states/init-ran`.
fn run_on_init() {
    let Some((_, dir, loaded_in)) = states() else { return };
    let Ok(program) = fs::read_to_string(dir.join("init-runs")) else { return };
    if root() == *loaded_in {
        return;
    }
    let outcome = match std::process::Command::new(program.trim()).status() {
        Ok(status) => format!("ran: {status}"),
        Err(e) => format!("refused: {e}"),
    };
    let file = fs::OpenOptions::new().create(true).append(true).open(dir.join("init-ran"));
    if let Ok(mut file) = file {
        let _ = writeln!(file, "{outcome}");
    }
}

fn state_file(pid: i32) -> PathBuf {
    state_dir().join(pid.to_string())
}

/// The state of `pid`, or the driver's answer for a process without CUDA (one that exists)
/// or without a process.
fn state(pid: i32) -> Result<i32, u32> {
    match fs::read_to_string(state_file(pid)) {
        Ok(text) => text.trim().parse().map_err(|_| OPERATING_SYSTEM),
        Err(_) if Path::new(&format!("/proc/{pid}")).exists() => Err(NOT_INITIALIZED),
        Err(_) => Err(OPERATING_SYSTEM),
    }
}

/// Sets the state of `pid`, atomically: a process polling its own state never reads a file
/// half written.
fn set_state(pid: i32, state: i32) -> u32 {
    let file = state_file(pid);
    let staging = file.with_extension(format!("{}.new", std::process::id()));
    let written = fs::write(&staging, state.to_string()).and_then(|()| fs::rename(&staging, &file));
    if written.is_ok() { SUCCESS } else { OPERATING_SYSTEM }
}

/// The inode of this process's namespace `kind` (`pid`, `mnt`).
fn namespace(kind: &str) -> String {
    let link = fs::read_link(format!("/proc/self/ns/{kind}")).unwrap_or_default();
    let text = link.to_string_lossy();
    text.split_once('[').and_then(|(_, rest)| rest.strip_suffix(']')).unwrap_or("?").to_owned()
}

/// Appends `call pid ...` to the log of calls.
fn log(call: &str, pid: i32, detail: &str) {
    let root = root();
    let (pidns, mntns) = (namespace("pid"), namespace("mnt"));
    let line = format!("{call} {pid} pidns={pidns} mntns={mntns} root={root} {detail}\n");
    let file = fs::OpenOptions::new().create(true).append(true).open(state_dir().join("calls"));
    if let Ok(mut file) = file {
        let _ = file.write_all(line.as_bytes());
    }
}

/// Moves `pid` from state `from` to `to` for checkpoint call `call`.
fn transition(call: &str, pid: i32, from: i32, to: i32, detail: &str) -> u32 {
    log(call, pid, detail);
    match state(pid) {
        Ok(s) if s == from => set_state(pid, to),
        Ok(_) => ILLEGAL_STATE,
        Err(code) => code,
    }
}

/// The caller's pid, as its pid namespace numbers it.
fn own_pid() -> i32 {
    i32::try_from(std::process::id()).unwrap_or(i32::MAX)
}

/// Makes the caller a CUDA process.
fn create_context() -> u32 {
    set_state(own_pid(), RUNNING)
}

/// Waits while the caller is locked or checkpointed.
fn synchronize() -> u32 {
    loop {
        match state(own_pid()) {
            Ok(RUNNING) => return SUCCESS,
            Ok(_) => std::thread::sleep(Duration::from_millis(10)),
            Err(code) => return code,
        }
    }
}

/// The minors of the `/dev/nvidiaN` files the caller sees, in order.
fn gpu_minors() -> Vec<u32> {
    let entries = fs::read_dir("/dev").into_iter().flatten().flatten();
    let mut minors: Vec<u32> =
        entries.filter_map(|e| e.file_name().to_str()?.strip_prefix("nvidia")?.parse().ok()).collect();
    minors.sort_unstable();
    minors
}

/// The UUID of the GPU of minor `minor`: fixed bytes, then the minor.
fn uuid_of(minor: u32) -> [u8; 16] {
    let mut uuid = *b"stasis-fake-\0\0\0\0";
    uuid[12..].copy_from_slice(&minor.to_be_bytes());
    uuid
}

fn error_name(code: u32) -> &'static [u8] {
    match code {
        SUCCESS => b"CUDA_SUCCESS\0",
        NOT_INITIALIZED => b"CUDA_ERROR_NOT_INITIALIZED\0",
        INVALID_DEVICE => b"CUDA_ERROR_INVALID_DEVICE\0",
        OPERATING_SYSTEM => b"CUDA_ERROR_OPERATING_SYSTEM\0",
        ILLEGAL_STATE => b"CUDA_ERROR_ILLEGAL_STATE\0",
        _ => b"CUDA_ERROR_UNKNOWN\0",
    }
}
