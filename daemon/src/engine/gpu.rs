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

use stasis_proto::stasis::store::v1::{AddressRange, GpuDevice};

use super::host::Host;
use super::{CheckpointError, Engine, ProgressFn, ProgressUpdate};
use crate::cuda::{self, CudaError, GpuCheckpointer, ProcessState};

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
    #[error(
        "pids {0:?} still hold NVIDIA device files after their CUDA checkpoint (NVML, or a driver \
         before 570, keeps them open); CRIU cannot dump them. Their CUDA state was put back and \
         nothing was frozen"
    )]
    DeviceFilesAfterCheckpoint(Vec<i32>),
    #[error("found {found} of the {recorded} CUDA processes the checkpoint recorded in the restored tree")]
    Missing { found: usize, recorded: usize },
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
    pub devices: Vec<GpuDevice>,
    /// Host memory the checkpoints created to hold device memory (see [`new_ranges`]).
    pub host_memory: Vec<AddressRange>,
    /// The driver's CUDA version (`cuDriverGetVersion`).
    pub driver_version: i32,
}

/// Locks and checkpoints every process of `pids` (those using CUDA), whose mappings are read
/// on `host`. On failure everything done so far is undone.
pub fn suspend(gpu: &Arc<dyn GpuCheckpointer>, host: &dyn Host, pids: &[i32]) -> Result<Suspended, GpuError> {
    let mut done = Suspended::default();
    let mut locked: Vec<i32> = Vec::new();
    let started = Instant::now();
    for &pid in pids {
        if let Err(source) = gpu.lock(pid, LOCK_TIMEOUT.as_millis() as u32) {
            // A lock reported failed may have been made all the same (its answer lost on the
            // way from a container): the rollback asks each process's state, this one's too.
            locked.push(pid);
            rollback(gpu, &locked);
            return Err(GpuError::Suspend { pid, source });
        }
        locked.push(pid);
    }
    done.times.lock_ms = started.elapsed().as_millis() as u64;
    let started = Instant::now();
    for &pid in pids {
        let before = host.private_writable_ranges(pid);
        if let Err(source) = gpu.checkpoint(pid) {
            rollback(gpu, &locked);
            return Err(GpuError::Suspend { pid, source });
        }
        done.pids.push(pid);
        let after = host.private_writable_ranges(pid);
        let added = new_ranges(&after, &before);
        done.host_memory.extend(added.into_iter().map(|(start, end)| AddressRange { pid, start, end }));
    }
    done.times.checkpoint_ms = started.elapsed().as_millis() as u64;
    let host_memory: u64 = done.host_memory.iter().map(|r| r.end - r.start).sum();
    info!(pids = ?done.pids, ?done.times, host_memory, "GPU state moved to host memory");
    Ok(done)
}

/// The parts of `after` not covered by `before` (both sorted, non-overlapping `[start, end)`
/// ranges): the mappings a CUDA checkpoint added to hold device memory. A lazy restore brings
/// these in eagerly, because `cuCheckpointProcessRestore` reads all of them at once and a
/// fault per page there would be slow (correct, but slow).
pub fn new_ranges(after: &[(u64, u64)], before: &[(u64, u64)]) -> Vec<(u64, u64)> {
    let mut out = Vec::new();
    for &(mut start, end) in after {
        for &(b_start, b_end) in before {
            if b_end <= start || b_start >= end {
                continue;
            }
            if b_start > start {
                out.push((start, b_start));
            }
            start = start.max(b_end);
        }
        if start < end {
            out.push((start, end));
        }
    }
    out
}

/// Puts device memory back and unlocks each process (after a dump that lets the tree run on,
/// or a failed one). Returns the time it took.
pub fn resume(gpu: &Arc<dyn GpuCheckpointer>, pids: &[i32]) -> Result<u64, GpuError> {
    put_back(gpu, pids, &[], false)
}

/// Restores the device memory of restored processes (on the GPUs named by `pairs`, or the
/// original ones) and unlocks them; a process the checkpoint recorded as a CUDA one that has
/// no CUDA state now is a failure.
pub fn reattach(
    gpu: &Arc<dyn GpuCheckpointer>,
    pids: &[i32],
    pairs: &[(crate::cuda::GpuUuid, crate::cuda::GpuUuid)],
) -> Result<u64, GpuError> {
    put_back(gpu, pids, pairs, true)
}

/// Puts each process of `pids` back to running on its GPUs, taken from the state the driver
/// reports: a process a crash or a failure left half way (locked but never checkpointed, or
/// restored but still locked) is finished too, and one that runs already is left alone, as is
/// one without CUDA state unless `no_cuda_fails`. Returns the time it took.
fn put_back(
    gpu: &Arc<dyn GpuCheckpointer>,
    pids: &[i32],
    pairs: &[(crate::cuda::GpuUuid, crate::cuda::GpuUuid)],
    no_cuda_fails: bool,
) -> Result<u64, GpuError> {
    let started = Instant::now();
    // Every process is tried, also after one fails: a process not tried would stay locked.
    let mut first_failure = None;
    for &pid in pids {
        let result = match gpu.state(pid) {
            Ok(None) if !no_cuda_fails => Ok(()),
            Ok(Some(ProcessState::Running)) => Ok(()),
            Ok(Some(ProcessState::Locked)) => gpu.unlock(pid),
            _ => gpu.restore(pid, pairs).and_then(|()| gpu.unlock(pid)),
        };
        if let Err(source) = result {
            let state =
                gpu.state(pid).ok().flatten().map(|s| format!("{s:?}")).unwrap_or_else(|| "unknown".into());
            warn!(pid, state = %state, error = %source, "GPU restore failed");
            first_failure.get_or_insert(GpuError::Stuck { pid, state, source });
        }
    }
    match first_failure {
        Some(e) => Err(e),
        None => Ok(started.elapsed().as_millis() as u64),
    }
}

/// Undoes a GPU phase that failed part way: every process of `locked` is put back as it was.
fn rollback(gpu: &Arc<dyn GpuCheckpointer>, locked: &[i32]) {
    if let Err(e) = resume(gpu, locked) {
        warn!(error = %e, "GPU rollback incomplete");
    }
}

impl Engine {
    /// The driver a tree's processes are reached through: stasisd's own, or for a tree in a
    /// Kubernetes container (whose init is `container_init`) the driver as the container sees
    /// it, each call made inside the container. None where this node has no driver.
    pub(super) fn gpu_for(&self, container_init: Option<i32>) -> Option<Arc<dyn GpuCheckpointer>> {
        let own = self.deps.gpu.clone()?;
        Some(match container_init {
            None => own,
            Some(init) => self.deps.host.cuda_in(&self.deps.reaper, init),
        })
    }

    /// Moves the device memory of the tree's CUDA processes into host memory, if it has any;
    /// `container_init` as for [`Engine::gpu_for`].
    pub(super) async fn suspend_gpu(
        &self,
        pids: &[i32],
        container_init: Option<i32>,
        progress: &ProgressFn,
    ) -> Result<Option<Suspended>, CheckpointError> {
        let candidates = self.deps.host.cuda_candidates(pids);
        if candidates.is_empty() {
            return Ok(None);
        }
        let gpu = self.gpu_for(container_init).ok_or_else(|| GpuError::NoDriver(candidates.clone()))?;
        progress(ProgressUpdate { phase: "gpu checkpoint", done: 0, total: 0 });
        let host = self.deps.host.clone();
        let suspended = tokio::task::spawn_blocking(move || {
            let (users, others): (Vec<i32>, Vec<i32>) =
                candidates.into_iter().partition(|p| gpu.state(*p).is_ok_and(|s| s.is_some()));
            // Children forked from a CUDA process keep its device files without a context of
            // their own; CRIU cannot dump those, so refuse before anything is frozen.
            let orphans = host.nvidia_device_holders(&others);
            if !orphans.is_empty() {
                return Err(GpuError::DeviceFilesWithoutContext(orphans));
            }
            let devices = gpu_devices(&gpu, &users);
            let rss_before = host.resident_bytes(&users);
            let mut suspended = suspend(&gpu, host.as_ref(), &users)?;
            // The checkpoint released the GPU: a device file still open would fail CRIU's dump
            // of a frozen tree, so refuse before it runs.
            let holding = host.nvidia_device_holders(&users);
            if !holding.is_empty() {
                rollback(&gpu, &suspended.pids);
                return Err(GpuError::DeviceFilesAfterCheckpoint(holding));
            }
            let rss_after = host.resident_bytes(&users);
            suspended.bytes = rss_after.saturating_sub(rss_before);
            suspended.devices = devices;
            suspended.driver_version = gpu.driver_version();
            Ok::<_, GpuError>(suspended)
        })
        .await
        .map_err(CheckpointError::panicked("GPU thread"))??;
        Ok(Some(suspended))
    }

    /// Puts device memory back and unlocks CUDA; returns how long it took. `container_init`
    /// as for [`Engine::gpu_for`].
    pub(super) async fn resume_gpu(
        &self,
        container_init: Option<i32>,
        pids: &[i32],
    ) -> Result<u64, CheckpointError> {
        if pids.is_empty() {
            return Ok(0);
        }
        let Some(gpu) = self.gpu_for(container_init) else { return Ok(0) };
        let pids = pids.to_vec();
        let took = tokio::task::spawn_blocking(move || resume(&gpu, &pids))
            .await
            .map_err(CheckpointError::panicked("GPU thread"))??;
        Ok(took)
    }
}

/// The GPUs the CUDA processes have open (all GPUs when that cannot be told), for the manifest.
fn gpu_devices(gpu: &Arc<dyn cuda::GpuCheckpointer>, pids: &[i32]) -> Vec<GpuDevice> {
    let all = gpu.gpus().unwrap_or_default();
    let open: Vec<cuda::GpuUuid> = cuda::open_gpu_minors(pids)
        .into_iter()
        .filter_map(|m| cuda::parse_uuid(&cuda::uuid_of_minor(m)?).ok())
        .collect();
    all.into_iter()
        .filter(|g| open.is_empty() || open.contains(&g.uuid))
        .map(|g| GpuDevice { uuid: g.uuid.to_vec(), name: g.name, total_memory: g.total_memory })
        .collect()
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::cuda::fake::FakeGpu;
    use crate::engine::host::fake::FakeHost;

    #[test]
    fn new_ranges_are_what_the_checkpoint_added() {
        // A new mapping, one that grew an existing one at both ends, and one left as it was.
        let before = [(0x1000, 0x2000), (0x5000, 0x6000), (0x9000, 0xa000)];
        let after = [(0x1000, 0x2000), (0x3000, 0x4000), (0x4000, 0x7000), (0x9000, 0xa000)];
        assert_eq!(new_ranges(&after, &before), vec![(0x3000, 0x4000), (0x4000, 0x5000), (0x6000, 0x7000)]);
        assert!(new_ranges(&before, &before).is_empty());
    }

    #[test]
    fn a_failed_checkpoint_leaves_every_process_running_and_unlocked() {
        let fake = Arc::new(FakeGpu { fail_checkpoint_of: Some(2), ..Default::default() });
        let gpu: Arc<dyn GpuCheckpointer> = fake.clone();
        let err = suspend(&gpu, &FakeHost::default(), &[1, 2]).unwrap_err();
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
    fn a_lock_reported_failed_is_undone_all_the_same() {
        let fake = Arc::new(FakeGpu { lose_lock_of: Some(2), ..Default::default() });
        let gpu: Arc<dyn GpuCheckpointer> = fake.clone();
        let err = suspend(&gpu, &FakeHost::default(), &[1, 2]).unwrap_err();
        assert!(matches!(err, GpuError::Suspend { pid: 2, .. }));
        assert!(fake.states.lock().unwrap().values().all(|s| *s == ProcessState::Running));
        assert_eq!(*fake.calls.lock().unwrap(), ["lock 1", "lock 2", "unlock 1", "unlock 2"]);
    }

    #[test]
    fn reattach_finishes_each_process_from_the_state_it_was_left_in() {
        // A crash inside the GPU phase: 1 locked only, 2 checkpointed, 3 never touched.
        let fake = Arc::new(FakeGpu::default());
        fake.states.lock().unwrap().extend([(1, ProcessState::Locked), (2, ProcessState::Checkpointed)]);
        let gpu: Arc<dyn GpuCheckpointer> = fake.clone();
        reattach(&gpu, &[1, 2, 3], &[]).unwrap();
        assert_eq!(*fake.calls.lock().unwrap(), ["unlock 1", "restore 2", "unlock 2"]);
        assert!(fake.states.lock().unwrap().values().all(|s| *s == ProcessState::Running));
    }

    #[test]
    fn suspend_then_resume_round_trip() {
        let fake = Arc::new(FakeGpu::default());
        let gpu: Arc<dyn GpuCheckpointer> = fake.clone();
        let s = suspend(&gpu, &FakeHost::default(), &[7]).unwrap();
        assert_eq!(s.pids, [7]);
        resume(&gpu, &s.pids).unwrap();
        assert_eq!(*fake.calls.lock().unwrap(), ["lock 7", "checkpoint 7", "restore 7", "unlock 7"]);
    }

    #[test]
    fn suspend_records_the_host_memory_each_checkpoint_added() {
        let gpu: Arc<dyn GpuCheckpointer> = Arc::new(FakeGpu::default());
        let host = FakeHost::default();
        // Before its checkpoint, 7 has one private writable mapping; after it, the driver has
        // grown it and added another. 8's mappings do not change.
        let answers = [
            (7, vec![vec![(0x1000, 0x2000)], vec![(0x1000, 0x3000), (0x8000, 0x9000)]]),
            (8, vec![vec![(0x1000, 0x2000)]]),
        ];
        host.private_ranges.lock().unwrap().extend(answers.map(|(pid, a)| (pid, a.into())));
        let s = suspend(&gpu, &host, &[7, 8]).unwrap();
        let range = |start, end| AddressRange { pid: 7, start, end };
        assert_eq!(s.host_memory, [range(0x2000, 0x3000), range(0x8000, 0x9000)]);
    }
}
