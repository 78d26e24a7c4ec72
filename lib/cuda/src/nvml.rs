//! NVML (`libnvidia-ml.so.1`), opened with `dlopen` at run time, for one question: which
//! processes used a GPU (its SM or its memory) since a given moment. Idle reclaim's GPU
//! activity signal: a training step whose CPU threads sleep while its kernels run is busy.
//!
//! Like `sys.rs`, nothing links against NVIDIA libraries; without a driver [`Nvml::load`]
//! fails with [`NvmlError::NotInstalled`]. Declarations follow `nvml.h` (stable since NVML 5):
//! `nvmlDeviceGetProcessUtilization` fills caller-allocated samples of
//! `{ unsigned int pid; unsigned long long timeStamp; unsigned int smUtil, memUtil, encUtil,
//! decUtil; }`, one per process with non-zero utilization newer than the given CPU timestamp
//! (microseconds since the epoch).

use std::collections::HashSet;
use std::ffi::c_uint;
use std::mem::{ManuallyDrop, offset_of, size_of};
use std::ptr;

use libloading::Library;

const LIBRARY: &str = "libnvidia-ml.so.1";

type NvmlReturn = c_uint;
const NVML_SUCCESS: NvmlReturn = 0;
const NVML_ERROR_NOT_SUPPORTED: NvmlReturn = 3;
const NVML_ERROR_NOT_FOUND: NvmlReturn = 6;
const NVML_ERROR_INSUFFICIENT_SIZE: NvmlReturn = 7;

/// `nvmlDevice_t`, an opaque handle.
type Device = *mut std::ffi::c_void;

#[repr(C)]
#[derive(Debug, Clone, Copy, Default)]
struct UtilizationSample {
    pid: c_uint,
    time_stamp: u64,
    sm_util: c_uint,
    mem_util: c_uint,
    enc_util: c_uint,
    dec_util: c_uint,
}

const _: () = assert!(size_of::<UtilizationSample>() == 32);
const _: () = assert!(offset_of!(UtilizationSample, time_stamp) == 8);
const _: () = assert!(offset_of!(UtilizationSample, sm_util) == 16);
const _: () = assert!(offset_of!(UtilizationSample, mem_util) == 20);

type FnInit = unsafe extern "C" fn() -> NvmlReturn;
type FnCount = unsafe extern "C" fn(count: *mut c_uint) -> NvmlReturn;
type FnHandle = unsafe extern "C" fn(index: c_uint, device: *mut Device) -> NvmlReturn;
type FnProcessUtilization = unsafe extern "C" fn(
    device: Device,
    samples: *mut UtilizationSample,
    count: *mut c_uint,
    last_seen_us: u64,
) -> NvmlReturn;

#[derive(Debug, thiserror::Error)]
pub enum NvmlError {
    #[error("{LIBRARY} cannot be loaded (no NVIDIA driver)")]
    NotInstalled(#[source] libloading::Error),
    #[error("{LIBRARY} lacks {0}")]
    Symbol(&'static str, #[source] libloading::Error),
    #[error("{call} failed with NVML error {code}")]
    Call { call: &'static str, code: NvmlReturn },
}

/// The loaded library and the GPUs it sees.
pub struct Nvml {
    /// Never unloaded: NVML keeps threads and state of its own once initialized.
    _lib: ManuallyDrop<Library>,
    process_utilization: FnProcessUtilization,
    devices: Vec<Device>,
}

// SAFETY: the device handles are opaque identifiers NVML hands out for the life of the
// process; NVML's functions are thread-safe, so handles and function pointers may be used from
// any thread.
unsafe impl Send for Nvml {}
// SAFETY: as above; `Nvml` has no interior state of its own.
unsafe impl Sync for Nvml {}

impl Nvml {
    /// Opens NVML, initializes it, and gets a handle of every GPU.
    pub fn load() -> Result<Nvml, NvmlError> {
        // SAFETY: loading the NVIDIA management library runs its ELF constructors, which only
        // set up its own state; nothing else in this process depends on it.
        let lib = unsafe { Library::new(LIBRARY) }.map_err(NvmlError::NotInstalled)?;
        // SAFETY: each alias below is the C signature `nvml.h` declares for the symbol it
        // names, and the library is never unloaded (`Nvml::_lib`).
        let (init, count, handle, process_utilization) = unsafe {
            (
                entry::<FnInit>(&lib, "nvmlInit_v2")?,
                entry::<FnCount>(&lib, "nvmlDeviceGetCount_v2")?,
                entry::<FnHandle>(&lib, "nvmlDeviceGetHandleByIndex_v2")?,
                entry::<FnProcessUtilization>(&lib, "nvmlDeviceGetProcessUtilization")?,
            )
        };
        // SAFETY: nvmlInit_v2 takes no arguments and may be called more than once.
        check("nvmlInit_v2", unsafe { init() })?;
        let mut n: c_uint = 0;
        // SAFETY: `n` is a live c_uint the call writes the device count into.
        check("nvmlDeviceGetCount_v2", unsafe { count(&raw mut n) })?;
        let mut devices = Vec::with_capacity(n as usize);
        for index in 0..n {
            let mut device: Device = ptr::null_mut();
            // SAFETY: `device` is a live handle slot the call writes into.
            check("nvmlDeviceGetHandleByIndex_v2", unsafe { handle(index, &raw mut device) })?;
            devices.push(device);
        }
        Ok(Nvml { _lib: ManuallyDrop::new(lib), process_utilization, devices })
    }

    /// The processes (host pids) with SM or memory utilization on any GPU in samples newer than
    /// `since_us` (microseconds since the epoch). GPUs that cannot say are skipped.
    pub fn active_since(&self, since_us: u64) -> Result<HashSet<u32>, NvmlError> {
        let mut active = HashSet::new();
        for &device in &self.devices {
            for sample in self.samples(device, since_us)? {
                if sample.sm_util > 0 || sample.mem_util > 0 {
                    active.insert(sample.pid);
                }
            }
        }
        Ok(active)
    }

    fn samples(&self, device: Device, since_us: u64) -> Result<Vec<UtilizationSample>, NvmlError> {
        const CALL: &str = "nvmlDeviceGetProcessUtilization";
        let mut count: c_uint = 0;
        // SAFETY: a NULL buffer asks for the number of samples, written into `count`.
        let code = unsafe { (self.process_utilization)(device, ptr::null_mut(), &raw mut count, since_us) };
        match code {
            NVML_SUCCESS | NVML_ERROR_INSUFFICIENT_SIZE => {}
            NVML_ERROR_NOT_FOUND | NVML_ERROR_NOT_SUPPORTED => return Ok(Vec::new()),
            code => return Err(NvmlError::Call { call: CALL, code }),
        }
        // Room for processes that start meanwhile.
        let mut samples = vec![UtilizationSample::default(); count as usize + 8];
        let mut count = samples.len() as c_uint;
        // SAFETY: `samples` holds `count` writable samples; the call writes at most `count` and
        // sets `count` to how many it wrote.
        let code =
            unsafe { (self.process_utilization)(device, samples.as_mut_ptr(), &raw mut count, since_us) };
        match code {
            NVML_SUCCESS => {
                samples.truncate(count as usize);
                Ok(samples)
            }
            NVML_ERROR_NOT_FOUND | NVML_ERROR_NOT_SUPPORTED => Ok(Vec::new()),
            code => Err(NvmlError::Call { call: CALL, code }),
        }
    }
}

/// Entry point `name` of `lib`.
///
/// # Safety
/// `T` must be the C signature of `name`.
unsafe fn entry<T: Copy>(lib: &Library, name: &'static str) -> Result<T, NvmlError> {
    // SAFETY: the caller vouches for `T`, as `sys::symbol` requires.
    unsafe { super::sys::symbol(lib, name) }.map_err(|e| NvmlError::Symbol(name, e))
}

fn check(call: &'static str, code: NvmlReturn) -> Result<(), NvmlError> {
    match code {
        NVML_SUCCESS => Ok(()),
        code => Err(NvmlError::Call { call, code }),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn without_a_driver_it_says_so() {
        if std::path::Path::new("/dev/nvidiactl").exists() {
            eprintln!("skipping: this machine has an NVIDIA driver");
            return;
        }
        assert!(matches!(Nvml::load(), Err(NvmlError::NotInstalled(_))));
    }
}
