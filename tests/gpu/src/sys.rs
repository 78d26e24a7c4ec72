//! The only unsafe code of this crate: a small safe wrapper over cudarc's driver API for the
//! memtest (one device, its primary context, the [`PTX`](crate::pattern::PTX) module, plain
//! `cuMemAlloc` memory, never managed memory).

use std::ffi::{CString, c_uint, c_void};
use std::fmt;

use cudarc::driver::result::{self, DriverError};
use cudarc::driver::sys;

/// Threads per block of both kernels.
const BLOCK: u32 = 256;
/// Upper bound on blocks: enough to fill any current GPU, small enough for few atomics.
const MAX_BLOCKS: u64 = 8192;

/// A CUDA failure, worded for a person.
#[derive(Debug)]
pub enum GpuError {
    /// No `libcuda.so` could be loaded.
    NoDriver,
    /// A driver call failed.
    Call { call: &'static str, code: u32, name: String, text: String },
}

impl fmt::Display for GpuError {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            Self::NoDriver => f.write_str("the CUDA driver library (libcuda.so.1) cannot be loaded"),
            Self::Call { call, code, name, text } => write!(f, "{call} failed: {name} ({code}): {text}"),
        }
    }
}

impl std::error::Error for GpuError {}

fn fail(call: &'static str) -> impl FnOnce(DriverError) -> GpuError {
    move |e| {
        let name = e.error_name().map(|s| s.to_string_lossy().into_owned()).unwrap_or_default();
        let text = e.error_string().map(|s| s.to_string_lossy().into_owned()).unwrap_or_default();
        GpuError::Call { call, code: e.0 as u32, name, text }
    }
}

/// What [`Gpu::verify`] found.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Verdict {
    pub mismatches: u64,
    /// The smallest index of a wrong word, if any.
    pub first_bad: Option<u64>,
    pub checksum: u64,
}

/// One device with its primary context current on the calling thread, and the memtest
/// kernels loaded.
pub struct Gpu {
    name: String,
    fill: sys::CUfunction,
    verify: sys::CUfunction,
}

/// `words` u32 words of device memory from `cuMemAlloc`, plus 3 u64 of scratch for
/// [`Gpu::verify`]. Freed on drop.
pub struct DeviceWords {
    ptr: sys::CUdeviceptr,
    words: u64,
    out: sys::CUdeviceptr,
}

impl Drop for DeviceWords {
    fn drop(&mut self) {
        // SAFETY: both pointers came from cuMemAlloc in `Gpu::alloc_words`, are freed only
        // here, and no kernel using them is pending (every launch is synchronised).
        unsafe {
            let _ = result::free_sync(self.ptr);
            let _ = result::free_sync(self.out);
        }
    }
}

impl DeviceWords {
    pub fn words(&self) -> u64 {
        self.words
    }
}

impl Gpu {
    /// Initialises CUDA, makes device `ordinal`'s primary context current on this thread and
    /// JIT-loads `ptx`.
    pub fn open(ordinal: i32, ptx: &str) -> Result<Self, GpuError> {
        // SAFETY: only tries to dlopen the candidate library names.
        if !unsafe { sys::is_culib_present() } {
            return Err(GpuError::NoDriver);
        }
        result::init().map_err(fail("cuInit"))?;
        let dev = result::device::get(ordinal).map_err(fail("cuDeviceGet"))?;
        let name = result::device::get_name(dev).map_err(fail("cuDeviceGetName"))?;
        // SAFETY: `dev` was returned by cuDeviceGet. The primary context is retained for the
        // life of the process (never released), so it stays valid while it is current.
        let ctx = unsafe { result::primary_ctx::retain(dev) }.map_err(fail("cuDevicePrimaryCtxRetain"))?;
        // SAFETY: `ctx` is a live, retained context.
        unsafe { result::ctx::set_current(ctx) }.map_err(fail("cuCtxSetCurrent"))?;
        let image = CString::new(ptx).map_err(|_| GpuError::Call {
            call: "cuModuleLoadData",
            code: 1,
            name: "CUDA_ERROR_INVALID_VALUE".into(),
            text: "the PTX text contains a NUL byte".into(),
        })?;
        // SAFETY: `image` is a NUL-terminated PTX text that lives across the call; the driver
        // copies what it needs. The module is never unloaded.
        let module =
            unsafe { result::module::load_data(image.as_ptr().cast()) }.map_err(fail("cuModuleLoadData"))?;
        // SAFETY: `module` was just loaded and is never unloaded.
        let fill = unsafe { result::module::get_function(module, c"fill".into()) }
            .map_err(fail("cuModuleGetFunction(fill)"))?;
        // SAFETY: as above.
        let verify = unsafe { result::module::get_function(module, c"verify".into()) }
            .map_err(fail("cuModuleGetFunction(verify)"))?;
        Ok(Self { name, fill, verify })
    }

    /// The device's name.
    pub fn name(&self) -> &str {
        &self.name
    }

    /// `cuMemAlloc` of `words` u32 words (not initialised: call [`Gpu::fill`]).
    pub fn alloc_words(&self, words: u64) -> Result<DeviceWords, GpuError> {
        let bytes = usize::try_from(words.saturating_mul(4)).unwrap_or(usize::MAX);
        // SAFETY: plain device allocation in the current context; the memory is only read
        // after `fill` has written it.
        let ptr = unsafe { result::malloc_sync(bytes) }.map_err(fail("cuMemAlloc"))?;
        // SAFETY: as above, 24 bytes of scratch, written by the host before each use.
        let out = match unsafe { result::malloc_sync(24) } {
            Ok(out) => out,
            Err(e) => {
                // SAFETY: `ptr` was allocated just above and is not used elsewhere.
                let _ = unsafe { result::free_sync(ptr) };
                return Err(fail("cuMemAlloc")(e));
            }
        };
        Ok(DeviceWords { ptr, words, out })
    }

    /// Writes generation `gen_` of the pattern into `buf` and waits for it.
    pub fn fill(&self, buf: &DeviceWords, seed: u32, gen_: u32) -> Result<(), GpuError> {
        let (mut p_buf, mut p_n, mut p_seed, mut p_gen) = (buf.ptr, buf.words, seed, gen_);
        let mut params: [*mut c_void; 4] = [
            (&raw mut p_buf).cast(),
            (&raw mut p_n).cast(),
            (&raw mut p_seed).cast(),
            (&raw mut p_gen).cast(),
        ];
        // SAFETY: `fill` takes (u64 buf, u64 n, u32 seed, u32 gen), matching the four
        // parameter pointers, which live until the synchronize below; `buf` holds `n` words.
        unsafe {
            result::launch_kernel(
                self.fill,
                grid(buf.words),
                (BLOCK, 1, 1),
                0,
                result::stream::null(),
                &mut params,
            )
        }
        .map_err(fail("cuLaunchKernel(fill)"))?;
        result::ctx::synchronize().map_err(fail("cuCtxSynchronize"))
    }

    /// Checks `buf` against generation `gen_` of the pattern and computes its checksum.
    pub fn verify(&self, buf: &DeviceWords, seed: u32, gen_: u32) -> Result<Verdict, GpuError> {
        let init: [u64; 3] = [0, u64::MAX, 0];
        // SAFETY: `out` is 24 bytes of device memory from cuMemAlloc; `init` is 24 bytes.
        unsafe { result::memcpy_htod_sync(buf.out, &init) }.map_err(fail("cuMemcpyHtoD"))?;
        let (mut p_buf, mut p_n, mut p_seed, mut p_gen, mut p_out) =
            (buf.ptr, buf.words, seed, gen_, buf.out);
        let mut params: [*mut c_void; 5] = [
            (&raw mut p_buf).cast(),
            (&raw mut p_n).cast(),
            (&raw mut p_seed).cast(),
            (&raw mut p_gen).cast(),
            (&raw mut p_out).cast(),
        ];
        // SAFETY: `verify` takes (u64 buf, u64 n, u32 seed, u32 gen, u64 out), matching the
        // five parameter pointers, which live until the synchronize below; `buf` holds `n`
        // words and `out` 3 u64.
        unsafe {
            result::launch_kernel(
                self.verify,
                grid(buf.words),
                (BLOCK, 1, 1),
                0,
                result::stream::null(),
                &mut params,
            )
        }
        .map_err(fail("cuLaunchKernel(verify)"))?;
        result::ctx::synchronize().map_err(fail("cuCtxSynchronize"))?;
        let mut res = [0u64; 3];
        // SAFETY: `out` holds 3 u64 written by the finished kernel; `res` has room for them.
        unsafe { result::memcpy_dtoh_sync(&mut res, buf.out) }.map_err(fail("cuMemcpyDtoH"))?;
        Ok(Verdict { mismatches: res[0], first_bad: (res[0] > 0).then_some(res[1]), checksum: res[2] })
    }
}

fn grid(words: u64) -> (c_uint, c_uint, c_uint) {
    let blocks = words.div_ceil(u64::from(BLOCK)).clamp(1, MAX_BLOCKS);
    (c_uint::try_from(blocks).unwrap_or(1), 1, 1)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn grid_is_bounded() {
        assert_eq!(grid(0), (1, 1, 1));
        assert_eq!(grid(1), (1, 1, 1));
        assert_eq!(grid(257), (2, 1, 1));
        assert_eq!(grid(1 << 40), (8192, 1, 1));
    }

    #[test]
    fn error_message_names_the_call() {
        let e = GpuError::Call {
            call: "cuMemAlloc",
            code: 2,
            name: "CUDA_ERROR_OUT_OF_MEMORY".into(),
            text: "out of memory".into(),
        };
        assert_eq!(e.to_string(), "cuMemAlloc failed: CUDA_ERROR_OUT_OF_MEMORY (2): out of memory");
    }
}
