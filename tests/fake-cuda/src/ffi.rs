//! The driver's C entry points the fake has (signatures as `cuda.h` declares them), each a
//! thin shell over the safe functions of the crate's root.

#![allow(unsafe_code)]

use std::ffi::{c_char, c_int, c_uint, c_void};

use super::{
    CHECKPOINTED, INVALID_DEVICE, LOCKED, RUNNING, SUCCESS, create_context, error_name, gpu_minors, log,
    state, state_dir, synchronize, transition, uuid_of,
};

/// The CUDA version it claims: 13.0 (driver 580), which restores onto other GPUs.
const VERSION: c_int = 13000;
const NAME: &[u8] = b"Stasis Fake GPU\0";
const MEMORY: usize = 80 << 30;

/// Writes `value` through `out` unless it is null.
///
/// # Safety
/// `out` is null or valid for a write of `T`.
unsafe fn put<T>(out: *mut T, value: T) -> u32 {
    if out.is_null() {
        return 1;
    }
    // SAFETY: non-null, and valid for a write of `T` by the caller's contract.
    unsafe { out.write(value) };
    SUCCESS
}

/// The minor of device ordinal `dev`, if the caller sees that many GPUs.
fn minor_of(dev: c_int) -> Option<u32> {
    gpu_minors().get(usize::try_from(dev).ok()?).copied()
}

#[unsafe(no_mangle)]
pub extern "C" fn cuInit(_flags: c_uint) -> u32 {
    crate::run_on_init();
    SUCCESS
}

/// # Safety
/// `out` is null or valid for a write.
#[unsafe(no_mangle)]
pub unsafe extern "C" fn cuDriverGetVersion(out: *mut c_int) -> u32 {
    // The first call a loader of the driver makes: the states are found while the caller's
    // root is still the one it loaded the library from.
    state_dir();
    // SAFETY: the caller's contract.
    unsafe { put(out, VERSION) }
}

/// # Safety
/// `out` is null or valid for a write.
#[unsafe(no_mangle)]
pub unsafe extern "C" fn cuDeviceGetCount(out: *mut c_int) -> u32 {
    let count = c_int::try_from(gpu_minors().len()).unwrap_or(c_int::MAX);
    // SAFETY: the caller's contract.
    unsafe { put(out, count) }
}

/// # Safety
/// `out` is null or valid for a write.
#[unsafe(no_mangle)]
pub unsafe extern "C" fn cuDeviceGet(out: *mut c_int, ordinal: c_int) -> u32 {
    match minor_of(ordinal) {
        // SAFETY: the caller's contract.
        Some(_) => unsafe { put(out, ordinal) },
        None => INVALID_DEVICE,
    }
}

/// # Safety
/// `name` is null or valid for writes of `len` bytes.
#[unsafe(no_mangle)]
pub unsafe extern "C" fn cuDeviceGetName(name: *mut c_char, len: c_int, dev: c_int) -> u32 {
    let len = usize::try_from(len).unwrap_or(0);
    if minor_of(dev).is_none() || name.is_null() || len < NAME.len() {
        return INVALID_DEVICE;
    }
    // SAFETY: `name` holds at least `len >= NAME.len()` bytes (caller's contract), and a
    // static string cannot overlap it.
    unsafe { std::ptr::copy_nonoverlapping(NAME.as_ptr().cast::<c_char>(), name, NAME.len()) };
    SUCCESS
}

/// # Safety
/// `uuid` is null or valid for a write of 16 bytes.
#[unsafe(no_mangle)]
pub unsafe extern "C" fn cuDeviceGetUuid_v2(uuid: *mut [u8; 16], dev: c_int) -> u32 {
    match minor_of(dev) {
        // SAFETY: the caller's contract.
        Some(minor) => unsafe { put(uuid, uuid_of(minor)) },
        None => INVALID_DEVICE,
    }
}

/// # Safety
/// `bytes` is null or valid for a write.
#[unsafe(no_mangle)]
pub unsafe extern "C" fn cuDeviceTotalMem_v2(bytes: *mut usize, dev: c_int) -> u32 {
    match minor_of(dev) {
        // SAFETY: the caller's contract.
        Some(_) => unsafe { put(bytes, MEMORY) },
        None => INVALID_DEVICE,
    }
}

/// # Safety
/// `name` is null or valid for a write of a pointer.
#[unsafe(no_mangle)]
pub unsafe extern "C" fn cuGetErrorName(code: u32, name: *mut *const c_char) -> u32 {
    // SAFETY: the caller's contract; the string is static.
    unsafe { put(name, error_name(code).as_ptr().cast::<c_char>()) }
}

/// # Safety
/// `ctx` is null or valid for a write of a pointer.
#[unsafe(no_mangle)]
pub unsafe extern "C" fn cuCtxCreate_v2(ctx: *mut *mut c_void, _flags: c_uint, dev: c_int) -> u32 {
    if minor_of(dev).is_none() {
        return INVALID_DEVICE;
    }
    match create_context() {
        // SAFETY: the caller's contract; the value is a token, never dereferenced.
        SUCCESS => unsafe { put(ctx, std::ptr::dangling_mut::<c_void>()) },
        failed => failed,
    }
}

#[unsafe(no_mangle)]
pub extern "C" fn cuCtxSynchronize() -> u32 {
    synchronize()
}

#[unsafe(no_mangle)]
pub extern "C" fn cuCheckpointProcessLock(pid: c_int, _args: *mut c_void) -> u32 {
    transition("lock", pid, RUNNING, LOCKED, "")
}

#[unsafe(no_mangle)]
pub extern "C" fn cuCheckpointProcessCheckpoint(pid: c_int, _args: *mut c_void) -> u32 {
    transition("checkpoint", pid, LOCKED, CHECKPOINTED, "")
}

/// The GPU pairs' count is logged; a null `args` is a restore on the same GPUs.
///
/// # Safety
/// `args` is null or points to a `CUcheckpointRestoreArgs` (its pairs' count at byte 8).
#[unsafe(no_mangle)]
pub unsafe extern "C" fn cuCheckpointProcessRestore(pid: c_int, args: *mut c_void) -> u32 {
    let pairs = match args.is_null() {
        true => 0,
        // SAFETY: a non-null `args` is the restore struct (caller's contract), whose pairs'
        // count is the `unsigned int` after the pairs' pointer.
        false => unsafe { args.cast::<u8>().add(8).cast::<c_uint>().read_unaligned() },
    };
    transition("restore", pid, CHECKPOINTED, LOCKED, &format!("pairs={pairs}"))
}

#[unsafe(no_mangle)]
pub extern "C" fn cuCheckpointProcessUnlock(pid: c_int, _args: *mut c_void) -> u32 {
    transition("unlock", pid, LOCKED, RUNNING, "")
}

/// # Safety
/// `out` is null or valid for a write.
#[unsafe(no_mangle)]
pub unsafe extern "C" fn cuCheckpointProcessGetState(pid: c_int, out: *mut c_int) -> u32 {
    match state(pid) {
        // SAFETY: the caller's contract.
        Ok(s) => unsafe { put(out, s) },
        Err(code) => code,
    }
}

/// The process's own pid stands for its restore thread.
///
/// # Safety
/// `out` is null or valid for a write.
#[unsafe(no_mangle)]
pub unsafe extern "C" fn cuCheckpointProcessGetRestoreThreadId(pid: c_int, out: *mut c_int) -> u32 {
    log("restore-thread", pid, "");
    match state(pid) {
        // SAFETY: the caller's contract.
        Ok(_) => unsafe { put(out, pid) },
        Err(code) => code,
    }
}
