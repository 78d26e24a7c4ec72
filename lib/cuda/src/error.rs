//! CUDA failures: every message names the driver call, its target and the `CUresult` by name
//! and number, e.g. `cuCheckpointProcessLock(pid 1234) failed: CUDA_ERROR_NOT_READY (600)`.

use std::fmt;

/// `CUresult` codes the daemon looks at (values from `cuda.h`).
pub mod code {
    pub const CUDA_SUCCESS: u32 = 0;
    pub const CUDA_ERROR_INVALID_VALUE: u32 = 1;
    pub const CUDA_ERROR_OUT_OF_MEMORY: u32 = 2;
    pub const CUDA_ERROR_NOT_INITIALIZED: u32 = 3;
    pub const CUDA_ERROR_NO_DEVICE: u32 = 100;
    pub const CUDA_ERROR_OPERATING_SYSTEM: u32 = 304;
    pub const CUDA_ERROR_ILLEGAL_STATE: u32 = 401;
    pub const CUDA_ERROR_NOT_FOUND: u32 = 500;
    /// What `cuCheckpointProcessLock` returns when its timeout expires (the process stays
    /// RUNNING).
    pub const CUDA_ERROR_NOT_READY: u32 = 600;
    pub const CUDA_ERROR_NOT_SUPPORTED: u32 = 801;
    pub const CUDA_ERROR_TIMEOUT: u32 = 909;
    pub const CUDA_ERROR_UNKNOWN: u32 = 999;
}

/// What a failed driver call was aimed at, for the message.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum CallTarget {
    /// A call about the driver as a whole (`cuInit`, `cuDeviceGetCount`).
    Driver,
    /// A call about one device ordinal.
    Device(i32),
    /// A checkpoint call on a process.
    Pid(i32),
}

impl fmt::Display for CallTarget {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            Self::Driver => Ok(()),
            Self::Device(d) => write!(f, "device {d}"),
            Self::Pid(p) => write!(f, "pid {p}"),
        }
    }
}

/// A CUDA operation failed or is not possible here.
#[derive(Debug, thiserror::Error)]
pub enum CudaError {
    /// No CUDA driver library on this machine: the normal case without an NVIDIA GPU.
    #[error("the CUDA driver library {library} is not installed or cannot be loaded")]
    NotInstalled {
        library: &'static str,
        #[source]
        source: libloading::Error,
    },
    /// The library is there but lacks a basic driver entry point.
    #[error("the CUDA driver library {library} has no symbol {symbol}")]
    MissingSymbol {
        library: &'static str,
        symbol: &'static str,
        #[source]
        source: libloading::Error,
    },
    /// The driver cannot do what was asked: too old for checkpointing (driver < 570) or for
    /// restoring onto other GPUs (CUDA < 13.0, driver < 580).
    #[error("CUDA checkpointing is not supported here: {reason}")]
    Unsupported { reason: String },
    /// A driver call returned an error.
    #[error("{call}({target}) failed: {name} ({code})")]
    Call {
        call: &'static str,
        target: CallTarget,
        /// The raw `CUresult`.
        code: u32,
        /// Its name from `cuGetErrorName`, or from the table in this module.
        name: String,
    },
    /// A GPU UUID string that cannot be parsed.
    #[error("invalid GPU UUID {input:?}: {reason}")]
    InvalidUuid { input: String, reason: &'static str },
    /// The helper inside a container could not use the driver there (see `remote.rs`), or
    /// could not be run at all.
    #[error("inside the container: {message}")]
    InContainer { message: String },
    /// More GPU pairs than the driver can be handed.
    #[error("too many GPU pairs for one restore: {count}")]
    TooManyGpuPairs { count: usize },
}

impl CudaError {
    /// The `CUresult` of a failed driver call, if this is one.
    pub fn code(&self) -> Option<u32> {
        match self {
            Self::Call { code, .. } => Some(*code),
            _ => None,
        }
    }

    /// A lock that gave up after its timeout: the process was left RUNNING, so nothing needs
    /// undoing, and trying again later may work.
    pub fn is_lock_timeout(&self) -> bool {
        matches!(
            self,
            Self::Call { call: "cuCheckpointProcessLock", code, .. }
                if *code == code::CUDA_ERROR_NOT_READY || *code == code::CUDA_ERROR_TIMEOUT
        )
    }

    /// Builds [`CudaError::Call`] naming `code` from the built-in table.
    #[cfg(test)]
    pub(crate) fn call(call: &'static str, target: CallTarget, code: u32) -> Self {
        Self::call_named(call, target, code, None)
    }

    /// Builds [`CudaError::Call`] with `name` from the driver when it has one.
    pub(crate) fn call_named(
        call: &'static str,
        target: CallTarget,
        code: u32,
        name: Option<String>,
    ) -> Self {
        let name = name.unwrap_or_else(|| error_name(code).to_string());
        Self::Call { call, target, code, name }
    }
}

/// The `cuda.h` name of a `CUresult`, for the codes checkpointing and device discovery can
/// return; "CUDA_ERROR_UNRECOGNIZED" for others (the driver's `cuGetErrorName` is used first
/// when the driver is loaded).
pub fn error_name(code: u32) -> &'static str {
    match code {
        0 => "CUDA_SUCCESS",
        1 => "CUDA_ERROR_INVALID_VALUE",
        2 => "CUDA_ERROR_OUT_OF_MEMORY",
        3 => "CUDA_ERROR_NOT_INITIALIZED",
        4 => "CUDA_ERROR_DEINITIALIZED",
        34 => "CUDA_ERROR_STUB_LIBRARY",
        46 => "CUDA_ERROR_DEVICE_UNAVAILABLE",
        100 => "CUDA_ERROR_NO_DEVICE",
        101 => "CUDA_ERROR_INVALID_DEVICE",
        200 => "CUDA_ERROR_INVALID_IMAGE",
        201 => "CUDA_ERROR_INVALID_CONTEXT",
        209 => "CUDA_ERROR_NO_BINARY_FOR_GPU",
        218 => "CUDA_ERROR_INVALID_PTX",
        222 => "CUDA_ERROR_UNSUPPORTED_PTX_VERSION",
        300 => "CUDA_ERROR_INVALID_SOURCE",
        304 => "CUDA_ERROR_OPERATING_SYSTEM",
        400 => "CUDA_ERROR_INVALID_HANDLE",
        401 => "CUDA_ERROR_ILLEGAL_STATE",
        500 => "CUDA_ERROR_NOT_FOUND",
        600 => "CUDA_ERROR_NOT_READY",
        700 => "CUDA_ERROR_ILLEGAL_ADDRESS",
        701 => "CUDA_ERROR_LAUNCH_OUT_OF_RESOURCES",
        719 => "CUDA_ERROR_LAUNCH_FAILED",
        800 => "CUDA_ERROR_NOT_PERMITTED",
        801 => "CUDA_ERROR_NOT_SUPPORTED",
        802 => "CUDA_ERROR_SYSTEM_NOT_READY",
        803 => "CUDA_ERROR_SYSTEM_DRIVER_MISMATCH",
        804 => "CUDA_ERROR_COMPAT_NOT_SUPPORTED_ON_DEVICE",
        909 => "CUDA_ERROR_TIMEOUT",
        999 => "CUDA_ERROR_UNKNOWN",
        _ => "CUDA_ERROR_UNRECOGNIZED",
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn call_message_names_code_by_name_and_number() {
        let e = CudaError::call("cuCheckpointProcessLock", CallTarget::Pid(1234), 600);
        assert_eq!(e.to_string(), "cuCheckpointProcessLock(pid 1234) failed: CUDA_ERROR_NOT_READY (600)");
        assert_eq!(e.code(), Some(600));
        assert!(e.is_lock_timeout());
    }

    #[test]
    fn driver_and_device_targets() {
        let e = CudaError::call("cuInit", CallTarget::Driver, 100);
        assert_eq!(e.to_string(), "cuInit() failed: CUDA_ERROR_NO_DEVICE (100)");
        let e = CudaError::call("cuDeviceGetName", CallTarget::Device(0), 101);
        assert_eq!(e.to_string(), "cuDeviceGetName(device 0) failed: CUDA_ERROR_INVALID_DEVICE (101)");
        assert!(!e.is_lock_timeout());
    }

    #[test]
    fn driver_name_wins_over_the_table() {
        let e = CudaError::call_named("cuX", CallTarget::Pid(1), 12345, Some("CUDA_ERROR_NEW_THING".into()));
        assert_eq!(e.to_string(), "cuX(pid 1) failed: CUDA_ERROR_NEW_THING (12345)");
        let e = CudaError::call("cuX", CallTarget::Pid(1), 12345);
        assert_eq!(e.to_string(), "cuX(pid 1) failed: CUDA_ERROR_UNRECOGNIZED (12345)");
    }

    #[test]
    fn table_names() {
        assert_eq!(error_name(code::CUDA_ERROR_ILLEGAL_STATE), "CUDA_ERROR_ILLEGAL_STATE");
        assert_eq!(error_name(code::CUDA_ERROR_NOT_INITIALIZED), "CUDA_ERROR_NOT_INITIALIZED");
        assert_eq!(error_name(code::CUDA_ERROR_OPERATING_SYSTEM), "CUDA_ERROR_OPERATING_SYSTEM");
        assert_eq!(error_name(code::CUDA_SUCCESS), "CUDA_SUCCESS");
    }

    #[test]
    fn lock_timeout_is_only_for_lock() {
        let e = CudaError::call("cuCheckpointProcessCheckpoint", CallTarget::Pid(7), 600);
        assert!(!e.is_lock_timeout());
    }
}
