//! The GPU phase of checkpoint and restore, over NVIDIA's driver checkpoint API.
//!
//! ```text
//! checkpoint: lock (with a timeout) -> checkpoint (device memory into the process's host
//!             memory, GPU released) -> CRIU dump -> if the tree runs on: restore -> unlock
//! restore:    CRIU restore -> restore (device memory back onto the GPU) -> unlock
//! ```
//! Every failure rolls back what was done, process by process, so no process is left locked
//! or checkpointed; where the driver refuses the rollback too, the error says which state the
//! process is in.

use std::sync::Arc;
use std::time::{Duration, Instant};

use tracing::{info, warn};

use crate::cuda::{CudaError, GpuCheckpointer, ProcessState};

/// How long a lock may wait for in-flight GPU work before the checkpoint gives up.
pub const LOCK_TIMEOUT: Duration = Duration::from_secs(30);

/// A GPU step failed.
#[derive(Debug, thiserror::Error)]
pub enum GpuError {
    #[error("process tree uses CUDA (pids {0:?}) but no NVIDIA driver is loaded in stasisd")]
    NoDriver(Vec<i32>),
    #[error(
        "pids {0:?} hold NVIDIA device files but have no CUDA context of their own (children \
         forked from a CUDA process, such as PyTorch DataLoader workers started with 'fork'); \
         CRIU cannot dump them. Nothing was frozen. Start such workers with the 'spawn' or \
         'forkserver' method"
    )]
    DeviceFilesWithoutContext(Vec<i32>),
    #[error("cannot list this node's GPUs")]
    Query(#[source] CudaError),
    #[error("GPU checkpoint of pid {pid} failed; the process was rolled back and runs on")]
    Suspend {
        pid: i32,
        #[source]
        source: CudaError,
    },
    #[error(
        "GPU restore of pid {pid} failed; the process is left in CUDA state {state}: \
         unlock it with `cuda-checkpoint --action unlock --pid {pid}` or stop it"
    )]
    Stuck {
        pid: i32,
        state: String,
        #[source]
        source: CudaError,
    },
}

/// Timings of the GPU phase.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct GpuTimes {
    pub lock_ms: u64,
    pub checkpoint_ms: u64,
    pub restore_ms: u64,
}

/// CUDA processes whose device memory has been moved into host memory.
#[derive(Debug, Default)]
pub struct Suspended {
    pub pids: Vec<i32>,
    pub times: GpuTimes,
    /// Device memory moved into host memory.
    pub bytes: u64,
    /// The GPUs the processes had open.
    pub devices: Vec<stasis_proto::stasis::v1::GpuDevice>,
}

/// Locks and checkpoints every process of `pids` (those using CUDA). On failure everything
/// done so far is undone.
pub fn suspend(gpu: &Arc<dyn GpuCheckpointer>, pids: &[i32]) -> Result<Suspended, GpuError> {
    let mut done = Suspended::default();
    let mut locked: Vec<i32> = Vec::new();
    let started = Instant::now();
    for &pid in pids {
        if let Err(source) = gpu.lock(pid, LOCK_TIMEOUT.as_millis() as u32) {
            rollback(gpu, &done.pids, &locked);
            return Err(GpuError::Suspend { pid, source });
        }
        locked.push(pid);
    }
    done.times.lock_ms = started.elapsed().as_millis() as u64;
    let started = Instant::now();
    for &pid in pids {
        if let Err(source) = gpu.checkpoint(pid) {
            rollback(gpu, &done.pids, &locked);
            return Err(GpuError::Suspend { pid, source });
        }
        done.pids.push(pid);
    }
    done.times.checkpoint_ms = started.elapsed().as_millis() as u64;
    info!(pids = ?done.pids, ?done.times, "GPU state moved to host memory");
    Ok(done)
}

/// Puts device memory back and unlocks each process (after a dump that lets the tree run on,
/// or a failed one). Returns the time it took.
pub fn resume(gpu: &Arc<dyn GpuCheckpointer>, pids: &[i32]) -> Result<u64, GpuError> {
    reattach(gpu, pids, &[])
}

/// Restores device memory (on the GPUs named by `pairs`, or the original ones) and unlocks.
pub fn reattach(
    gpu: &Arc<dyn GpuCheckpointer>,
    pids: &[i32],
    pairs: &[(crate::cuda::GpuUuid, crate::cuda::GpuUuid)],
) -> Result<u64, GpuError> {
    let started = Instant::now();
    for &pid in pids {
        let result = gpu.restore(pid, pairs).and_then(|()| gpu.unlock(pid));
        if let Err(source) = result {
            let state =
                gpu.state(pid).ok().flatten().map(|s| format!("{s:?}")).unwrap_or_else(|| "unknown".into());
            return Err(GpuError::Stuck { pid, state, source });
        }
    }
    Ok(started.elapsed().as_millis() as u64)
}

fn rollback(gpu: &Arc<dyn GpuCheckpointer>, checkpointed: &[i32], locked: &[i32]) {
    for &pid in checkpointed {
        if let Err(e) = gpu.restore(pid, &[]) {
            warn!(pid, error = %e, "GPU rollback: restore failed");
        }
    }
    for &pid in locked {
        if gpu.state(pid).ok().flatten() == Some(ProcessState::Locked)
            && let Err(e) = gpu.unlock(pid)
        {
            warn!(pid, error = %e, "GPU rollback: unlock failed");
        }
    }
}

#[cfg(test)]
mod tests {
    use std::sync::Mutex;

    use super::*;
    use crate::cuda::GpuInfo;

    /// A driver that records calls and fails the checkpoint of one pid.
    #[derive(Default)]
    struct Fake {
        calls: Mutex<Vec<String>>,
        fail_checkpoint_of: Option<i32>,
        states: Mutex<std::collections::HashMap<i32, ProcessState>>,
    }

    impl Fake {
        fn log(&self, call: &str, pid: i32, to: Option<ProcessState>) {
            self.calls.lock().unwrap().push(format!("{call} {pid}"));
            if let Some(s) = to {
                self.states.lock().unwrap().insert(pid, s);
            }
        }
    }

    impl GpuCheckpointer for Fake {
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
            self.log("lock", pid, Some(ProcessState::Locked));
            Ok(())
        }
        fn checkpoint(&self, pid: i32) -> Result<(), CudaError> {
            if self.fail_checkpoint_of == Some(pid) {
                return Err(CudaError::Unsupported { reason: "injected".into() });
            }
            self.log("checkpoint", pid, Some(ProcessState::Checkpointed));
            Ok(())
        }
        fn restore(
            &self,
            pid: i32,
            _pairs: &[(crate::cuda::GpuUuid, crate::cuda::GpuUuid)],
        ) -> Result<(), CudaError> {
            self.log("restore", pid, Some(ProcessState::Locked));
            Ok(())
        }
        fn unlock(&self, pid: i32) -> Result<(), CudaError> {
            self.log("unlock", pid, Some(ProcessState::Running));
            Ok(())
        }
    }

    #[test]
    fn a_failed_checkpoint_leaves_every_process_running_and_unlocked() {
        let fake = Arc::new(Fake { fail_checkpoint_of: Some(2), ..Default::default() });
        let gpu: Arc<dyn GpuCheckpointer> = fake.clone();
        let err = suspend(&gpu, &[1, 2]).unwrap_err();
        assert!(matches!(err, GpuError::Suspend { pid: 2, .. }));
        let states = fake.states.lock().unwrap().clone();
        assert_eq!(states.get(&1), Some(&ProcessState::Running));
        assert_eq!(states.get(&2), Some(&ProcessState::Running));
        assert_eq!(
            *fake.calls.lock().unwrap(),
            ["lock 1", "lock 2", "checkpoint 1", "restore 1", "unlock 1", "unlock 2"]
        );
    }

    #[test]
    fn suspend_then_resume_round_trip() {
        let fake = Arc::new(Fake::default());
        let gpu: Arc<dyn GpuCheckpointer> = fake.clone();
        let s = suspend(&gpu, &[7]).unwrap();
        assert_eq!(s.pids, [7]);
        resume(&gpu, &s.pids).unwrap();
        assert_eq!(*fake.calls.lock().unwrap(), ["lock 7", "checkpoint 7", "restore 7", "unlock 7"]);
    }
}
