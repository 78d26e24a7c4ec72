//! Raw FFI to the CUDA driver (`libcuda.so.1`), opened with `dlopen` at run time: the CUDA
//! side of the daemon's `unsafe` code (the rest is in `linux/sys.rs`).
//!
//! Nothing here links against CUDA, so the daemon builds, runs and unit-tests on machines
//! without a GPU. [`Api::load`] resolves every symbol once; each method below is a safe shim
//! around one driver call and returns the raw `CUresult` (turning codes into errors is the job
//! of the safe API in `cuda/mod.rs`).
//!
//! Declarations follow `cuda.h` (CUDA 12.8 .. 13.4): the `cuCheckpoint*` functions and their
//! argument structs, whose reserved fields must be zero.

use std::ffi::{CStr, c_char, c_int, c_uint};
use std::mem::{ManuallyDrop, offset_of, size_of};
use std::ptr;

use libloading::Library;

/// `CUresult`, a C enum whose values are all non-negative.
pub(super) type CuResult = c_uint;
/// `CUdevice`: a device ordinal handle.
pub(super) type CuDevice = c_int;

pub(super) const CUDA_SUCCESS: CuResult = 0;

/// `CUuuid`: `struct { char bytes[16]; }`.
#[repr(C)]
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub(super) struct CuUuid {
    pub bytes: [u8; 16],
}

/// `CUcheckpointLockArgs` (12.8 .. 13.4): `{ unsigned int timeoutMs; unsigned int reserved0;
/// cuuint64_t reserved1[7]; }`. `timeoutMs` 0 means no timeout; reserved fields must be zero.
#[repr(C)]
#[derive(Debug, Clone, Copy, Default)]
pub(super) struct LockArgs {
    pub timeout_ms: c_uint,
    pub reserved0: c_uint,
    pub reserved1: [u64; 7],
}

/// `CUcheckpointCheckpointArgs`: 64 reserved bytes before 13.4; in 13.4 the first 8 bytes are
/// `customStorageInfo_out` (NULL = the driver keeps the copy in host memory). We never need a
/// field, so we pass NULL for the whole struct, which the API allows ("args are optional").
/// Declared for the pointer type and the layout checks only.
#[repr(C)]
#[derive(Debug, Clone, Copy, Default)]
#[allow(dead_code, reason = "never built: NULL is passed; kept for the signature and layout checks")]
pub(super) struct CheckpointArgs {
    pub reserved: [u64; 8],
}

/// `CUcheckpointUnlockArgs` (12.8 .. 13.4): `{ cuuint64_t reserved[8]; }`. Passed as NULL.
#[repr(C)]
#[derive(Debug, Clone, Copy, Default)]
#[allow(dead_code, reason = "never built: NULL is passed; kept for the signature and layout checks")]
pub(super) struct UnlockArgs {
    pub reserved: [u64; 8],
}

/// `CUcheckpointGpuPair` (CUDA 13.0+): `{ CUuuid oldUuid; CUuuid newUuid; }`.
#[repr(C)]
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub(super) struct GpuPair {
    pub old_uuid: CuUuid,
    pub new_uuid: CuUuid,
}

/// `CUcheckpointRestoreArgs`, one declaration valid for every driver that has GPU pairs.
///
/// The published layouts (gpu_anchors.md (d)) differ only after `gpuPairsCount`:
/// - before 13.3: `{ CUcheckpointGpuPair *gpuPairs; unsigned int gpuPairsCount;
///   char reserved[52 - sizeof(ptr)]; cuuint64_t reserved1; }`: ptr at 0, count at 8, 44
///   reserved bytes at 12..56, `reserved1` at 56..64;
/// - 13.3.0: `{ gpuPairs; gpuPairsCount; char reserved[64 - sizeof(ptr) - sizeof(unsigned)]; }`:
///   ptr at 0, count at 8, 52 reserved bytes at 12..64;
/// - 13.4: `{ gpuPairs; gpuPairsCount; unsigned int padding0;
///   CUcheckpointCustomStorageInfo **customStorageInfo_out; char reserved[40]; }`: ptr at 0,
///   count at 8, padding at 12..16, `customStorageInfo_out` at 16..24 (NULL = restore from the
///   driver's host copy), reserved 24..64.
///
/// In all three the pointer is the first 8 bytes, the `unsigned int` count sits at offset 8,
/// the struct is 64 bytes, and every other byte is reserved, padding, or (13.4) a pointer whose
/// NULL value means "no custom storage", i.e. all must be zero for our use. So a 64-byte struct
/// with the pointer, the count and 52 zero bytes is a valid argument for each of them. Before
/// CUDA 13.0 the struct was all reserved; we never pass a non-NULL one to such a driver (GPU
/// pairs need 13.0, checked by the caller).
#[repr(C)]
#[derive(Debug, Clone, Copy)]
pub(super) struct RestoreArgs {
    pub gpu_pairs: *mut GpuPair,
    pub gpu_pairs_count: c_uint,
    pub reserved0: c_uint,
    pub reserved1: [u64; 6],
}

const _: () = assert!(size_of::<CuUuid>() == 16);
const _: () = assert!(size_of::<LockArgs>() == 64);
const _: () = assert!(offset_of!(LockArgs, timeout_ms) == 0);
const _: () = assert!(offset_of!(LockArgs, reserved1) == 8);
const _: () = assert!(size_of::<CheckpointArgs>() == 64);
const _: () = assert!(size_of::<UnlockArgs>() == 64);
const _: () = assert!(size_of::<GpuPair>() == 32);
const _: () = assert!(offset_of!(GpuPair, new_uuid) == 16);
const _: () = assert!(size_of::<RestoreArgs>() == 64);
const _: () = assert!(offset_of!(RestoreArgs, gpu_pairs) == 0);
const _: () = assert!(offset_of!(RestoreArgs, gpu_pairs_count) == 8);
const _: () = assert!(offset_of!(RestoreArgs, reserved0) == 12);
const _: () = assert!(offset_of!(RestoreArgs, reserved1) == 16);

type FnInit = unsafe extern "C" fn(flags: c_uint) -> CuResult;
type FnGetInt = unsafe extern "C" fn(out: *mut c_int) -> CuResult;
type FnDeviceGet = unsafe extern "C" fn(device: *mut CuDevice, ordinal: c_int) -> CuResult;
type FnDeviceGetName = unsafe extern "C" fn(name: *mut c_char, len: c_int, dev: CuDevice) -> CuResult;
type FnDeviceGetUuid = unsafe extern "C" fn(uuid: *mut CuUuid, dev: CuDevice) -> CuResult;
type FnDeviceTotalMem = unsafe extern "C" fn(bytes: *mut usize, dev: CuDevice) -> CuResult;
type FnGetErrorName = unsafe extern "C" fn(code: CuResult, name: *mut *const c_char) -> CuResult;
type FnLock = unsafe extern "C" fn(pid: c_int, args: *mut LockArgs) -> CuResult;
type FnCheckpoint = unsafe extern "C" fn(pid: c_int, args: *mut CheckpointArgs) -> CuResult;
type FnRestore = unsafe extern "C" fn(pid: c_int, args: *mut RestoreArgs) -> CuResult;
type FnUnlock = unsafe extern "C" fn(pid: c_int, args: *mut UnlockArgs) -> CuResult;
type FnPidInt = unsafe extern "C" fn(pid: c_int, out: *mut c_int) -> CuResult;

/// Why [`Api::load`] failed.
#[derive(Debug)]
pub(super) enum LoadError {
    /// `dlopen` failed: the library is not installed (or not loadable).
    Open(libloading::Error),
    /// A basic driver symbol is missing: not a usable libcuda.
    Symbol(&'static str, libloading::Error),
    /// A checkpoint symbol is missing: a driver older than 570.
    CheckpointSymbol(&'static str),
}

/// The resolved driver entry points.
pub(super) struct Api {
    /// Kept open for the life of the process: once `cuInit` has run, libcuda has started
    /// threads of its own and does not support being unloaded, so the handle is never closed
    /// and every function pointer below stays valid.
    _lib: ManuallyDrop<Library>,
    init: FnInit,
    driver_get_version: FnGetInt,
    device_get_count: FnGetInt,
    device_get: FnDeviceGet,
    device_get_name: FnDeviceGetName,
    device_get_uuid: FnDeviceGetUuid,
    device_total_mem: FnDeviceTotalMem,
    get_error_name: FnGetErrorName,
    lock: FnLock,
    checkpoint: FnCheckpoint,
    restore: FnRestore,
    unlock: FnUnlock,
    get_state: FnPidInt,
    get_restore_thread_id: FnPidInt,
}

/// Resolves `name` in `lib` as a function pointer of type `T`.
///
/// # Safety
/// `T` must be the C signature of `name` as the driver declares it.
pub(super) unsafe fn symbol<T: Copy>(lib: &Library, name: &'static str) -> Result<T, libloading::Error> {
    // SAFETY: the caller guarantees that `T` is the exported function's signature; the value
    // is copied out of the `Symbol`, and the library it points into is never unloaded (see
    // `Api::_lib`), so the pointer outlives the borrow.
    unsafe { lib.get::<T>(name.as_bytes()).map(|s| *s) }
}

impl Api {
    /// Opens `library` and resolves the symbols. Does not call `cuInit`.
    pub(super) fn load(library: &str) -> Result<Self, LoadError> {
        // SAFETY: loading libcuda runs its ELF constructors, which only set up the driver's
        // own state; libcuda is designed to be loaded with dlopen (the CUDA runtime does so).
        let lib = unsafe { Library::new(library) }.map_err(LoadError::Open)?;
        macro_rules! core {
            ($name:literal) => {
                // SAFETY: the type alias this is assigned to is the function's C signature.
                unsafe { symbol(&lib, $name) }.map_err(|e| LoadError::Symbol($name, e))?
            };
        }
        macro_rules! ckpt {
            ($name:literal) => {
                // SAFETY: the type alias this is assigned to is the function's C signature.
                unsafe { symbol(&lib, $name) }.map_err(|_| LoadError::CheckpointSymbol($name))?
            };
        }
        let device_get_uuid: FnDeviceGetUuid = {
            // SAFETY: both names have the signature `CUresult (CUuuid*, CUdevice)`.
            match unsafe { symbol(&lib, "cuDeviceGetUuid_v2") } {
                Ok(f) => f,
                Err(_) => core!("cuDeviceGetUuid"),
            }
        };
        let api = Self {
            init: core!("cuInit"),
            driver_get_version: core!("cuDriverGetVersion"),
            device_get_count: core!("cuDeviceGetCount"),
            device_get: core!("cuDeviceGet"),
            device_get_name: core!("cuDeviceGetName"),
            device_get_uuid,
            device_total_mem: core!("cuDeviceTotalMem_v2"),
            get_error_name: core!("cuGetErrorName"),
            lock: ckpt!("cuCheckpointProcessLock"),
            checkpoint: ckpt!("cuCheckpointProcessCheckpoint"),
            restore: ckpt!("cuCheckpointProcessRestore"),
            unlock: ckpt!("cuCheckpointProcessUnlock"),
            get_state: ckpt!("cuCheckpointProcessGetState"),
            get_restore_thread_id: ckpt!("cuCheckpointProcessGetRestoreThreadId"),
            _lib: ManuallyDrop::new(lib),
        };
        Ok(api)
    }

    /// `cuInit(0)`.
    pub(super) fn init(&self) -> CuResult {
        // SAFETY: plain value argument; cuInit may be called any number of times.
        unsafe { (self.init)(0) }
    }

    /// `cuDriverGetVersion`: 1000 * major + 10 * minor of the CUDA version the driver supports.
    pub(super) fn driver_version(&self) -> Result<c_int, CuResult> {
        let mut v: c_int = 0;
        // SAFETY: `v` is a valid, writable c_int for the duration of the call.
        check(unsafe { (self.driver_get_version)(&mut v) })?;
        Ok(v)
    }

    /// `cuDeviceGetCount`.
    pub(super) fn device_count(&self) -> Result<c_int, CuResult> {
        let mut n: c_int = 0;
        // SAFETY: `n` is a valid, writable c_int for the duration of the call.
        check(unsafe { (self.device_get_count)(&mut n) })?;
        Ok(n)
    }

    /// `cuDeviceGet`.
    pub(super) fn device(&self, ordinal: c_int) -> Result<CuDevice, CuResult> {
        let mut dev: CuDevice = 0;
        // SAFETY: `dev` is a valid, writable CUdevice for the duration of the call.
        check(unsafe { (self.device_get)(&mut dev, ordinal) })?;
        Ok(dev)
    }

    /// `cuDeviceGetName`, lossily decoded.
    pub(super) fn device_name(&self, dev: CuDevice) -> Result<String, CuResult> {
        let mut buf = [0 as c_char; 256];
        let len = c_int::try_from(buf.len()).unwrap_or(c_int::MAX);
        // SAFETY: `buf` is writable for `len` bytes; the driver writes at most `len` bytes,
        // NUL-terminated.
        check(unsafe { (self.device_get_name)(buf.as_mut_ptr(), len, dev) })?;
        // Force a terminator in case the driver filled the whole buffer.
        if let Some(last) = buf.last_mut() {
            *last = 0;
        }
        // SAFETY: `buf` holds a NUL byte (set just above) and lives until the end of this call.
        let name = unsafe { CStr::from_ptr(buf.as_ptr()) };
        Ok(name.to_string_lossy().into_owned())
    }

    /// `cuDeviceGetUuid_v2` (or `cuDeviceGetUuid` on drivers without it).
    pub(super) fn device_uuid(&self, dev: CuDevice) -> Result<[u8; 16], CuResult> {
        let mut uuid = CuUuid::default();
        // SAFETY: `uuid` is a valid, writable 16-byte CUuuid for the duration of the call.
        check(unsafe { (self.device_get_uuid)(&mut uuid, dev) })?;
        Ok(uuid.bytes)
    }

    /// `cuDeviceTotalMem_v2`, in bytes.
    pub(super) fn device_total_mem(&self, dev: CuDevice) -> Result<usize, CuResult> {
        let mut bytes: usize = 0;
        // SAFETY: `bytes` is a valid, writable size_t for the duration of the call.
        check(unsafe { (self.device_total_mem)(&mut bytes, dev) })?;
        Ok(bytes)
    }

    /// `cuGetErrorName`: `None` for a code the driver does not know.
    pub(super) fn error_name(&self, code: CuResult) -> Option<String> {
        let mut name: *const c_char = ptr::null();
        // SAFETY: `name` is a valid, writable pointer slot for the duration of the call.
        let rc = unsafe { (self.get_error_name)(code, &mut name) };
        if rc != CUDA_SUCCESS || name.is_null() {
            return None;
        }
        // SAFETY: on success the driver points `name` at a static NUL-terminated string in
        // libcuda, which is never unloaded; it is copied out right away.
        let name = unsafe { CStr::from_ptr(name) };
        Some(name.to_string_lossy().into_owned())
    }

    /// `cuCheckpointProcessLock(pid, &{timeoutMs})`.
    pub(super) fn process_lock(&self, pid: c_int, timeout_ms: c_uint) -> CuResult {
        let mut args = LockArgs { timeout_ms, ..LockArgs::default() };
        // SAFETY: `args` is a valid 64-byte CUcheckpointLockArgs with zeroed reserved fields,
        // live for the duration of the (blocking) call.
        unsafe { (self.lock)(pid, &mut args) }
    }

    /// `cuCheckpointProcessCheckpoint(pid, NULL)`.
    pub(super) fn process_checkpoint(&self, pid: c_int) -> CuResult {
        // SAFETY: the args pointer is optional; NULL selects the defaults.
        unsafe { (self.checkpoint)(pid, ptr::null_mut()) }
    }

    /// `cuCheckpointProcessRestore(pid, args)`: NULL args when `pairs` is empty, else a
    /// [`RestoreArgs`] pointing at a copy of `pairs`.
    pub(super) fn process_restore(&self, pid: c_int, pairs: &[GpuPair]) -> Result<CuResult, TooManyPairs> {
        if pairs.is_empty() {
            // SAFETY: the args pointer is optional; NULL restores onto the same GPUs.
            return Ok(unsafe { (self.restore)(pid, ptr::null_mut()) });
        }
        let mut pairs = pairs.to_vec();
        let count = c_uint::try_from(pairs.len()).map_err(|_| TooManyPairs)?;
        let mut args = RestoreArgs {
            gpu_pairs: pairs.as_mut_ptr(),
            gpu_pairs_count: count,
            reserved0: 0,
            reserved1: [0; 6],
        };
        // SAFETY: `args` is a valid 64-byte CUcheckpointRestoreArgs (see its doc comment) with
        // all reserved bytes zero; `gpu_pairs` points at `count` initialised pairs in `pairs`,
        // which outlives the (blocking) call.
        Ok(unsafe { (self.restore)(pid, &mut args) })
    }

    /// `cuCheckpointProcessUnlock(pid, NULL)`.
    pub(super) fn process_unlock(&self, pid: c_int) -> CuResult {
        // SAFETY: the args pointer is optional; NULL selects the defaults.
        unsafe { (self.unlock)(pid, ptr::null_mut()) }
    }

    /// `cuCheckpointProcessGetState`: the raw `CUprocessState` value.
    pub(super) fn process_state(&self, pid: c_int) -> Result<c_int, CuResult> {
        let mut state: c_int = -1;
        // SAFETY: `state` is a valid, writable 4-byte enum slot for the duration of the call.
        check(unsafe { (self.get_state)(pid, &mut state) })?;
        Ok(state)
    }

    /// `cuCheckpointProcessGetRestoreThreadId`.
    pub(super) fn restore_thread_id(&self, pid: c_int) -> Result<c_int, CuResult> {
        let mut tid: c_int = 0;
        // SAFETY: `tid` is a valid, writable c_int for the duration of the call.
        check(unsafe { (self.get_restore_thread_id)(pid, &mut tid) })?;
        Ok(tid)
    }
}

/// More GPU pairs than a `c_uint` counts.
#[derive(Debug)]
pub(super) struct TooManyPairs;

fn check(code: CuResult) -> Result<(), CuResult> {
    if code == CUDA_SUCCESS { Ok(()) } else { Err(code) }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn restore_args_are_zero_but_pointer_and_count() {
        let mut pair = GpuPair::default();
        let args = RestoreArgs { gpu_pairs: &mut pair, gpu_pairs_count: 1, reserved0: 0, reserved1: [0; 6] };
        assert_eq!(args.gpu_pairs_count, 1);
        assert_eq!(args.reserved0, 0);
        assert!(args.reserved1.iter().all(|&w| w == 0));
    }

    #[test]
    fn lock_args_default_is_zero() {
        let args = LockArgs { timeout_ms: 5000, ..LockArgs::default() };
        assert_eq!(args.timeout_ms, 5000);
        assert_eq!(args.reserved0, 0);
        assert_eq!(args.reserved1, [0; 7]);
    }

    #[test]
    fn missing_library_is_an_open_error() {
        let err = Api::load("libstasis-does-not-exist.so.1").err();
        assert!(matches!(err, Some(LoadError::Open(_))), "{err:?}");
    }
}
