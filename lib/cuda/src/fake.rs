//! A driver for tests: records every call, keeps each process's state, and fails the calls it
//! is told to fail.

use std::collections::HashMap;
use std::sync::Mutex;

use super::{CudaError, GpuCheckpointer, GpuInfo, GpuUuid, ProcessState};

#[derive(Debug, Default)]
pub struct FakeGpu {
    /// Every call, as "lock 7", "checkpoint 7", ...
    pub calls: Mutex<Vec<String>>,
    pub fail_checkpoint_of: Option<i32>,
    /// Its lock is made, but reported failed (an answer lost on its way back).
    pub lose_lock_of: Option<i32>,
    pub fail_restore_of: Option<i32>,
    pub states: Mutex<HashMap<i32, ProcessState>>,
}

impl FakeGpu {
    fn log(&self, call: &str, pid: i32, to: ProcessState) {
        self.calls.lock().unwrap().push(format!("{call} {pid}"));
        self.states.lock().unwrap().insert(pid, to);
    }

    pub fn calls(&self) -> Vec<String> {
        self.calls.lock().unwrap().clone()
    }

    fn injected() -> CudaError {
        CudaError::Unsupported { reason: "injected".into() }
    }
}

impl GpuCheckpointer for FakeGpu {
    fn driver_version(&self) -> i32 {
        13000
    }

    fn gpus(&self) -> Result<Vec<GpuInfo>, CudaError> {
        Ok(Vec::new())
    }

    fn state(&self, pid: i32) -> Result<Option<ProcessState>, CudaError> {
        Ok(Some(*self.states.lock().unwrap().get(&pid).unwrap_or(&ProcessState::Running)))
    }

    fn lock(&self, pid: i32, _timeout_ms: u32) -> Result<(), CudaError> {
        self.log("lock", pid, ProcessState::Locked);
        match self.lose_lock_of == Some(pid) {
            true => Err(Self::injected()),
            false => Ok(()),
        }
    }

    fn checkpoint(&self, pid: i32) -> Result<(), CudaError> {
        if self.fail_checkpoint_of == Some(pid) {
            return Err(Self::injected());
        }
        self.log("checkpoint", pid, ProcessState::Checkpointed);
        Ok(())
    }

    fn restore(&self, pid: i32, _pairs: &[(GpuUuid, GpuUuid)]) -> Result<(), CudaError> {
        if self.fail_restore_of == Some(pid) {
            return Err(Self::injected());
        }
        self.log("restore", pid, ProcessState::Locked);
        Ok(())
    }

    fn unlock(&self, pid: i32) -> Result<(), CudaError> {
        self.log("unlock", pid, ProcessState::Running);
        Ok(())
    }
}
