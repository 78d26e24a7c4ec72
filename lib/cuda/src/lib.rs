//! NVIDIA GPUs: the CUDA driver's process checkpoint API, behind [`GpuCheckpointer`].
//!
//! - [`CudaDriver`] opens `libcuda.so.1` with `dlopen` at run time ([`sys`] holds its
//!   unsafe code), so stasisd builds and runs without CUDA; on such a machine
//!   [`CudaDriver::load`] returns [`CudaError::NotInstalled`].
//! - [`cuda_candidates`] finds the processes of a tree that have CUDA loaded, from /proc alone.
//! - [`nvml`] asks NVML which processes used a GPU lately (idle reclaim's GPU signal); its FFI
//!   is the CUDA area's other unsafe code.
//!
//! Per process the driver moves through these states (gpu_anchors.md (d)):
//!
//! ```text
//!          lock               checkpoint                 restore                unlock
//! RUNNING -----> LOCKED ----------------> CHECKPOINTED -----------> LOCKED -----------> RUNNING
//! ```
//!
//! Lock blocks the process's further CUDA calls and waits for submitted work; checkpoint copies
//! device memory into host memory inside the process and releases the GPU (so CRIU can dump
//! it); restore copies it back, optionally onto other GPUs; unlock lets CUDA calls run again.
//! Nothing is rolled back on error: a caller must unlock (after restore, if checkpointed) on
//! every error path.
//!
//! With CRIU (checked on an H100, driver 580, CRIU 4.1.1): lock and checkpoint, then
//! `criu dump` (no `/dev/nvidia*` descriptor is left open, so CRIU needs no CUDA plugin); on
//! `criu restore` the process comes back CHECKPOINTED with its restore thread, and restore
//! then unlock resume it. The restore thread must be able to run during checkpoint and
//! restore: do not call them while the tree is frozen or ptrace-stopped.
//!
//! Every [`GpuCheckpointer`] call blocks, lock and checkpoint and restore for as long as the
//! GPU work or the copy takes (seconds per GiB at worst): call them from a blocking thread.

#![deny(unsafe_code)]

mod error;
#[cfg(any(test, feature = "testing"))]
pub mod fake;
#[allow(unsafe_code)]
pub mod nvml;
mod procs;
pub mod remote;
#[allow(unsafe_code)]
mod sys;
mod uuid;

use std::fmt;
use std::path::Path;
use std::time::Instant;

use tracing::{debug, info};

pub use error::{CallTarget, CudaError, code, error_name};
pub use procs::{cuda_candidates, loaded_driver, nvidia_device_holders, open_gpu_minors, uuid_of_minor};
pub use uuid::{GpuUuid, format_uuid, parse_uuid};

/// One GPU as the CUDA driver sees it.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct GpuInfo {
    /// The CUDA device ordinal (subject to `CUDA_VISIBLE_DEVICES` of the daemon).
    pub index: u32,
    pub uuid: GpuUuid,
    pub name: String,
    /// Bytes.
    pub total_memory: u64,
}

/// `CUprocessState`: where a process is in the lock/checkpoint/restore/unlock cycle.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum ProcessState {
    Running,
    Locked,
    Checkpointed,
    /// An uncorrectable error during checkpoint or restore.
    Failed,
    /// Custom-storage checkpoint in progress (13.4 drivers).
    Checkpointing,
    /// Custom-storage restore in progress (13.4 drivers).
    Restoring,
    /// A value this code does not know.
    Unknown(i32),
}

impl ProcessState {
    /// From the raw `CUprocessState` value.
    pub fn from_raw(v: i32) -> Self {
        match v {
            0 => Self::Running,
            1 => Self::Locked,
            2 => Self::Checkpointed,
            3 => Self::Failed,
            4 => Self::Checkpointing,
            5 => Self::Restoring,
            other => Self::Unknown(other),
        }
    }

    /// The raw `CUprocessState` value.
    pub fn raw(self) -> i32 {
        match self {
            Self::Running => 0,
            Self::Locked => 1,
            Self::Checkpointed => 2,
            Self::Failed => 3,
            Self::Checkpointing => 4,
            Self::Restoring => 5,
            Self::Unknown(v) => v,
        }
    }
}

impl fmt::Display for ProcessState {
    /// The words `cuda-checkpoint --get-state` prints.
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            Self::Running => f.write_str("running"),
            Self::Locked => f.write_str("locked"),
            Self::Checkpointed => f.write_str("checkpointed"),
            Self::Failed => f.write_str("failed"),
            Self::Checkpointing => f.write_str("checkpointing"),
            Self::Restoring => f.write_str("restoring"),
            Self::Unknown(v) => write!(f, "unknown ({v})"),
        }
    }
}

/// The boundary the engine uses; a fake implements it in engine unit tests.
pub trait GpuCheckpointer: Send + Sync {
    /// `cuDriverGetVersion`: 1000 * major + 10 * minor of the CUDA version the driver
    /// supports, e.g. 13000 for CUDA 13.0 (driver 580).
    fn driver_version(&self) -> i32;
    /// The GPUs the driver sees, by ordinal.
    fn gpus(&self) -> Result<Vec<GpuInfo>, CudaError>;
    /// The checkpoint state of `pid`; `Ok(None)` when the process does not use CUDA (see
    /// [`CudaDriver`] for which driver answers mean that).
    fn state(&self, pid: i32) -> Result<Option<ProcessState>, CudaError>;
    /// RUNNING -> LOCKED, waiting at most `timeout_ms` (0 = forever; never pass 0) for the
    /// process's submitted GPU work. On timeout the process stays RUNNING and the error's
    /// [`CudaError::is_lock_timeout`] is true.
    fn lock(&self, pid: i32, timeout_ms: u32) -> Result<(), CudaError>;
    /// LOCKED -> CHECKPOINTED: device memory into the process's host memory, GPU released.
    fn checkpoint(&self, pid: i32) -> Result<(), CudaError>;
    /// CHECKPOINTED -> LOCKED. `gpu_pairs`: (old uuid, new uuid); empty = restore on the same
    /// GPUs. Non-identity pairs need CUDA 13.0 (driver 580) or newer, else
    /// [`CudaError::Unsupported`]; they must name every GPU the checkpointed process used
    /// (NVIDIA's tests map every GPU visible to the kernel driver), onto GPUs of the same chip
    /// with enough memory.
    fn restore(&self, pid: i32, gpu_pairs: &[(GpuUuid, GpuUuid)]) -> Result<(), CudaError>;
    /// LOCKED -> RUNNING.
    fn unlock(&self, pid: i32) -> Result<(), CudaError>;
}

/// `13000` -> `"13.0"`, `12080` -> `"12.8"`.
pub fn format_driver_version(v: i32) -> String {
    format!("{}.{}", v / 1000, (v % 1000) / 10)
}

/// The CUDA version from which the checkpoint API exists (driver 570).
const MIN_CHECKPOINT_VERSION: i32 = 12080;
/// The CUDA version from which restore takes GPU pairs (driver 580).
const MIN_GPU_PAIRS_VERSION: i32 = 13000;

/// Driver answers of `cuCheckpointProcessGetState` and `cuCheckpointProcessGetRestoreThreadId`
/// that mean "this pid has no CUDA state".
///
/// Measured on driver 580.159.04 (CUDA 13.0, H100): a process that never loaded libcuda, and
/// one that loaded it without calling `cuInit`, both get CUDA_ERROR_NOT_INITIALIZED (3), from
/// GetState, Lock, Checkpoint and Unlock alike. A process that called `cuInit` (even without a
/// context) is RUNNING and has a restore thread. A pid that does not exist gets
/// CUDA_ERROR_OPERATING_SYSTEM (304), which is mapped to "no CUDA state" only when
/// `/proc/PID` is gone (304 is also how the driver reports real failures, CC#44).
/// INVALID_VALUE (1) is not seen on 580, but the documented answer set of these calls is
/// SUCCESS, INVALID_VALUE, NOT_INITIALIZED, NOT_SUPPORTED, and NVIDIA's ai-dynamo snapshot
/// helper treats NOT_INITIALIZED and INVALID_VALUE from these probes as "the pid does not own
/// CUDA checkpoint state", so it is included for other drivers. NOT_SUPPORTED is not: it is
/// what an unsupported platform answers, which must not read as "no CUDA here".
const NO_CUDA_STATE: [u32; 2] = [code::CUDA_ERROR_NOT_INITIALIZED, code::CUDA_ERROR_INVALID_VALUE];

/// Whether a failed per-pid probe means "no CUDA state" (see [`NO_CUDA_STATE`]).
fn means_no_cuda(pid: i32, rc: u32) -> bool {
    NO_CUDA_STATE.contains(&rc)
        || (rc == code::CUDA_ERROR_OPERATING_SYSTEM && !Path::new(&format!("/proc/{pid}")).exists())
}

/// The CUDA driver, loaded at run time.
///
/// [`GpuCheckpointer::state`] and [`CudaDriver::restore_thread_id`] return `Ok(None)` for
/// CUDA_ERROR_NOT_INITIALIZED (3) and CUDA_ERROR_INVALID_VALUE (1), and for
/// CUDA_ERROR_OPERATING_SYSTEM (304) when the pid no longer exists.
pub struct CudaDriver {
    api: sys::Api,
    version: i32,
}

/// The driver library opened and checked, not yet initialised ([`CudaDriver::open`]).
pub struct OpenDriver {
    api: sys::Api,
    version: i32,
}

impl OpenDriver {
    /// Calls `cuInit(0)` (which `cuCheckpointProcessRestore` requires of its caller unless
    /// persistence mode is on): the driver is ready.
    pub fn init(self) -> Result<CudaDriver, CudaError> {
        let rc = self.api.init();
        if rc != sys::CUDA_SUCCESS {
            return Err(named(&self.api, "cuInit", CallTarget::Driver, rc));
        }
        info!(cuda_version = %format_driver_version(self.version), "CUDA driver loaded");
        Ok(CudaDriver { api: self.api, version: self.version })
    }
}

impl fmt::Debug for CudaDriver {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("CudaDriver").field("version", &self.version).finish_non_exhaustive()
    }
}

impl CudaDriver {
    /// The library [`CudaDriver::load`] opens.
    pub const LIBRARY: &'static str = "libcuda.so.1";

    /// Opens `libcuda.so.1`, resolves the symbols and calls `cuInit(0)` (which
    /// `cuCheckpointProcessRestore` requires of its caller unless persistence mode is on).
    ///
    /// [`CudaError::NotInstalled`] when the library is absent (the normal case without a
    /// GPU); [`CudaError::Unsupported`] for a driver without the checkpoint API (before 570);
    /// a [`CudaError::Call`] when `cuInit` fails (e.g. `CUDA_ERROR_NO_DEVICE` with the
    /// library but no GPU).
    pub fn load() -> Result<Self, CudaError> {
        Self::open(Self::LIBRARY)?.init()
    }

    /// The first half of [`CudaDriver::load`]: opens `library` (a name the dynamic loader
    /// looks up, or a path), resolves the symbols and checks the driver's version, without
    /// calling `cuInit`, so that a caller may change what the driver's initialisation sees (its
    /// root directory, say) before [`OpenDriver::init`].
    pub fn open(library: &'static str) -> Result<OpenDriver, CudaError> {
        let api = sys::Api::load(library).map_err(|e| match e {
            sys::LoadError::Open(source) => CudaError::NotInstalled { library, source },
            sys::LoadError::Symbol(symbol, source) => CudaError::MissingSymbol { library, symbol, source },
            sys::LoadError::CheckpointSymbol(symbol) => CudaError::Unsupported {
                reason: format!(
                    "{library} has no {symbol}: the checkpoint API needs NVIDIA driver 570 (CUDA 12.8) or newer"
                ),
            },
        })?;
        let version =
            api.driver_version().map_err(|c| named(&api, "cuDriverGetVersion", CallTarget::Driver, c))?;
        if version < MIN_CHECKPOINT_VERSION {
            return Err(CudaError::Unsupported {
                reason: format!(
                    "the driver supports CUDA {}, the checkpoint API needs CUDA 12.8 (driver 570) or newer",
                    format_driver_version(version)
                ),
            });
        }
        Ok(OpenDriver { api, version })
    }

    /// `cuCheckpointProcessGetRestoreThreadId`: the driver thread of `pid` that performs
    /// checkpoint and restore inside it. It must be able to run while the driver works on the
    /// process: if the process is frozen or ptrace-stopped (CRIU's `--leave-stopped`, a
    /// cgroup freezer), checkpoint and restore wait for it. `Ok(None)` as for
    /// [`GpuCheckpointer::state`].
    pub fn restore_thread_id(&self, pid: i32) -> Result<Option<i32>, CudaError> {
        match self.api.restore_thread_id(pid) {
            Ok(tid) => Ok(Some(tid)),
            Err(c) if means_no_cuda(pid, c) => Ok(None),
            Err(c) => Err(self.err("cuCheckpointProcessGetRestoreThreadId", CallTarget::Pid(pid), c)),
        }
    }

    fn err(&self, call: &'static str, target: CallTarget, code: u32) -> CudaError {
        named(&self.api, call, target, code)
    }

    /// Runs one process-level driver call, logging how it went and how long it took.
    fn process_call(
        &self,
        call: &'static str,
        pid: i32,
        f: impl FnOnce() -> Result<u32, CudaError>,
    ) -> Result<(), CudaError> {
        let start = Instant::now();
        let rc = f()?;
        let elapsed_ms = u64::try_from(start.elapsed().as_millis()).unwrap_or(u64::MAX);
        if rc == sys::CUDA_SUCCESS {
            debug!(pid, call, elapsed_ms, "CUDA checkpoint call done");
            Ok(())
        } else {
            let err = self.err(call, CallTarget::Pid(pid), rc);
            debug!(pid, call, elapsed_ms, code = rc, %err, "CUDA checkpoint call failed");
            Err(err)
        }
    }
}

fn named(api: &sys::Api, call: &'static str, target: CallTarget, code: u32) -> CudaError {
    CudaError::call_named(call, target, code, api.error_name(code))
}

impl GpuCheckpointer for CudaDriver {
    fn driver_version(&self) -> i32 {
        self.version
    }

    fn gpus(&self) -> Result<Vec<GpuInfo>, CudaError> {
        let count =
            self.api.device_count().map_err(|c| self.err("cuDeviceGetCount", CallTarget::Driver, c))?;
        let mut gpus = Vec::new();
        for ordinal in 0..count {
            let at = CallTarget::Device(ordinal);
            let dev = self.api.device(ordinal).map_err(|c| self.err("cuDeviceGet", at, c))?;
            let name = self.api.device_name(dev).map_err(|c| self.err("cuDeviceGetName", at, c))?;
            let uuid = self.api.device_uuid(dev).map_err(|c| self.err("cuDeviceGetUuid_v2", at, c))?;
            let total = self.api.device_total_mem(dev).map_err(|c| self.err("cuDeviceTotalMem_v2", at, c))?;
            gpus.push(GpuInfo {
                index: u32::try_from(ordinal).unwrap_or_default(),
                uuid,
                name,
                total_memory: u64::try_from(total).unwrap_or(u64::MAX),
            });
        }
        Ok(gpus)
    }

    fn state(&self, pid: i32) -> Result<Option<ProcessState>, CudaError> {
        match self.api.process_state(pid) {
            Ok(raw) => Ok(Some(ProcessState::from_raw(raw))),
            Err(c) if means_no_cuda(pid, c) => {
                debug!(pid, code = c, name = error_name(c), "process has no CUDA state");
                Ok(None)
            }
            Err(c) => Err(self.err("cuCheckpointProcessGetState", CallTarget::Pid(pid), c)),
        }
    }

    fn lock(&self, pid: i32, timeout_ms: u32) -> Result<(), CudaError> {
        debug!(pid, timeout_ms, "locking CUDA process");
        self.process_call("cuCheckpointProcessLock", pid, || Ok(self.api.process_lock(pid, timeout_ms)))
    }

    fn checkpoint(&self, pid: i32) -> Result<(), CudaError> {
        self.process_call("cuCheckpointProcessCheckpoint", pid, || Ok(self.api.process_checkpoint(pid)))?;
        info!(pid, "CUDA process checkpointed: device memory is in host memory");
        Ok(())
    }

    fn restore(&self, pid: i32, gpu_pairs: &[(GpuUuid, GpuUuid)]) -> Result<(), CudaError> {
        // Pairs that map every GPU onto itself are a same-GPU restore: take the driver's
        // default path (NULL args) rather than its migration path.
        let pairs: Vec<sys::GpuPair> = if gpu_pairs.iter().all(|(old, new)| old == new) {
            Vec::new()
        } else {
            gpu_pairs
                .iter()
                .map(|(old, new)| sys::GpuPair {
                    old_uuid: sys::CuUuid { bytes: *old },
                    new_uuid: sys::CuUuid { bytes: *new },
                })
                .collect()
        };
        if !pairs.is_empty() && self.version < MIN_GPU_PAIRS_VERSION {
            return Err(CudaError::Unsupported {
                reason: format!(
                    "restoring onto other GPUs needs CUDA 13.0 (driver 580) or newer, this driver supports CUDA {}",
                    format_driver_version(self.version)
                ),
            });
        }
        let remap: Vec<String> = gpu_pairs
            .iter()
            .filter(|(o, n)| o != n)
            .map(|(o, n)| format!("{} -> {}", format_uuid(o), format_uuid(n)))
            .collect();
        debug!(pid, ?remap, "restoring CUDA process");
        self.process_call("cuCheckpointProcessRestore", pid, || {
            self.api
                .process_restore(pid, &pairs)
                .map_err(|sys::TooManyPairs| CudaError::TooManyGpuPairs { count: pairs.len() })
        })?;
        info!(pid, ?remap, "CUDA process restored: device memory is back on the GPU");
        Ok(())
    }

    fn unlock(&self, pid: i32) -> Result<(), CudaError> {
        self.process_call("cuCheckpointProcessUnlock", pid, || Ok(self.api.process_unlock(pid)))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn process_states_from_raw() {
        let all = [
            (0, ProcessState::Running),
            (1, ProcessState::Locked),
            (2, ProcessState::Checkpointed),
            (3, ProcessState::Failed),
            (4, ProcessState::Checkpointing),
            (5, ProcessState::Restoring),
            (6, ProcessState::Unknown(6)),
            (-1, ProcessState::Unknown(-1)),
        ];
        for (raw, state) in all {
            assert_eq!(ProcessState::from_raw(raw), state);
            assert_eq!(state.raw(), raw);
        }
        assert_eq!(ProcessState::Checkpointed.to_string(), "checkpointed");
        assert_eq!(ProcessState::Unknown(32718).to_string(), "unknown (32718)");
    }

    #[test]
    fn driver_versions() {
        assert_eq!(format_driver_version(13000), "13.0");
        assert_eq!(format_driver_version(12080), "12.8");
        assert_eq!(format_driver_version(13040), "13.4");
    }

    #[test]
    fn load_without_libcuda_is_not_installed() {
        if Path::new("/usr/lib/x86_64-linux-gnu/libcuda.so.1").exists() {
            eprintln!("skipping load_without_libcuda_is_not_installed: libcuda.so.1 is installed");
            return;
        }
        match CudaDriver::load() {
            Err(e @ CudaError::NotInstalled { .. }) => {
                assert_eq!(
                    e.to_string(),
                    "the CUDA driver library libcuda.so.1 is not installed or cannot be loaded"
                );
            }
            other => panic!("expected NotInstalled, got {other:?}"),
        }
    }

    #[test]
    fn no_cuda_answers() {
        let me = i32::try_from(std::process::id()).unwrap();
        assert!(means_no_cuda(me, code::CUDA_ERROR_NOT_INITIALIZED));
        assert!(means_no_cuda(me, code::CUDA_ERROR_INVALID_VALUE));
        // 304 for a live pid is a real failure; for a vanished one it means "gone".
        assert!(!means_no_cuda(me, code::CUDA_ERROR_OPERATING_SYSTEM));
        assert!(means_no_cuda(i32::MAX, code::CUDA_ERROR_OPERATING_SYSTEM));
        assert!(!means_no_cuda(me, code::CUDA_ERROR_NOT_SUPPORTED));
        assert!(!means_no_cuda(me, code::CUDA_ERROR_ILLEGAL_STATE));
    }

    /// The trait is object-safe and shareable across threads, as the engine holds it.
    #[test]
    fn trait_is_object_safe() {
        fn takes(_: Option<std::sync::Arc<dyn GpuCheckpointer>>) {}
        takes(None);
    }
}
