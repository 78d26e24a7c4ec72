//! The CUDA driver as a Kubernetes container's processes see it (`Containers::cuda_in`).
//!
//! Each call runs `stasis-pod cuda` (stasisd's own copy, beside it) in the container's
//! namespaces (nsenter), with the pids as the container numbers them. It starts from stasisd's
//! root directory, so that its loader, its libraries and the driver library (the node's, the
//! one stasisd loaded, handed over as its standard input) are stasisd's, never the image's
//! (whose `/etc/ld.so.preload` or libraries would otherwise run with stasisd's privileges);
//! only then does it move into the container's root and initialise the driver there, which
//! so sees the container's GPU devices. A call that does not end in [`CALL_LIMIT`] is killed.
//! The answer comes back as one JSON line (`stasis_cuda::remote`).

use std::fs::File;
use std::os::unix::process::CommandExt;
use std::path::PathBuf;
use std::process::Command;
use std::sync::OnceLock;
use std::time::Duration;

use tracing::debug;

use crate::cuda::remote::{Answer, Call};
use crate::cuda::{CallTarget, CudaError, GpuCheckpointer, GpuInfo, GpuUuid, ProcessState, format_uuid};
use crate::linux::reaper::{ExitKind, Reaper};

/// How long one driver call may take: a checkpoint or restore copies all of a process's
/// device memory (tens of GB at a few GB/s at worst).
const CALL_LIMIT: Duration = Duration::from_secs(15 * 60);

/// The helper stasisd runs: `stasis-pod` beside stasisd's own program.
fn helper() -> Result<PathBuf, CudaError> {
    let exe = std::env::current_exe()
        .map_err(|e| CudaError::InContainer { message: format!("finding stasisd's program: {e}") })?;
    Ok(exe.with_file_name("stasis-pod"))
}

/// The driver inside the container whose init is `init` (a pid of this host).
pub struct ContainerCuda {
    init: i32,
    reaper: Reaper,
    version: OnceLock<i32>,
}

impl ContainerCuda {
    pub fn new(reaper: Reaper, init: i32) -> Self {
        Self { init, reaper, version: OnceLock::new() }
    }

    /// `pid` (this host's) as the container numbers it.
    fn inside(&self, pid: i32) -> Result<i32, CudaError> {
        let namespace = crate::linux::container::pid_namespace;
        let same = matches!((namespace(pid), namespace(self.init)), (Ok(a), Ok(b)) if a == b);
        let inner = crate::linux::proc::pid_inside(pid, self.init).filter(|_| same);
        inner.ok_or_else(|| CudaError::InContainer {
            message: format!("process {pid} is not in the pid namespace of container init {}", self.init),
        })
    }

    /// Runs `call` in the container; a failed driver call comes back as the driver's error,
    /// about `target`.
    fn call(&self, call: &Call, target: CallTarget) -> Result<Answer, CudaError> {
        let fail = |message: String| CudaError::InContainer { message };
        let library = crate::cuda::loaded_driver()
            .ok_or_else(|| fail("stasisd has no CUDA driver library loaded to hand over".into()))?;
        let library =
            File::open(&library).map_err(|e| fail(format!("opening {}: {e}", library.display())))?;
        let text = serde_json::to_string(call).map_err(|e| fail(e.to_string()))?;
        let mut cmd = Command::new("nsenter");
        // Its root and working directory stay stasisd's ("/" as stasisd sees it) in the
        // container's namespaces; the helper moves into the container's root itself.
        cmd.args(["--target", &self.init.to_string(), "--all", "--root=/", "--wd=/", "--"])
            .arg(helper()?)
            .args(["cuda", "--root", &format!("/proc/{}/root", self.init), &text])
            .env_clear()
            .process_group(0);
        let (exit, stdout, stderr) = self
            .reaper
            .run_blocking(cmd, library.into(), Some(CALL_LIMIT))
            .map_err(|e| fail(format!("running the CUDA helper in container init {}: {e}", self.init)))?;
        debug!(init = self.init, call = %text, %exit, answer = %stdout.trim(), "CUDA call inside a container");
        if exit != ExitKind::Exited(0) {
            return Err(fail(format!("the CUDA helper failed ({exit}): {}", stderr.trim())));
        }
        Answer::from_output(&stdout)?.into_result(target)
    }

    /// Runs a call about `pid` that answers nothing but success.
    fn process_call(&self, pid: i32, call: impl FnOnce(i32) -> Call) -> Result<(), CudaError> {
        match self.call(&call(self.inside(pid)?), CallTarget::Pid(pid))? {
            Answer::Done => Ok(()),
            other => Err(unexpected(&other)),
        }
    }
}

fn unexpected(answer: &Answer) -> CudaError {
    CudaError::InContainer { message: format!("the CUDA helper answered {answer:?}") }
}

impl GpuCheckpointer for ContainerCuda {
    /// 0 when the driver inside cannot be asked.
    fn driver_version(&self) -> i32 {
        *self.version.get_or_init(|| match self.call(&Call::Version, CallTarget::Driver) {
            Ok(Answer::Version { version }) => version,
            _ => 0,
        })
    }

    fn gpus(&self) -> Result<Vec<GpuInfo>, CudaError> {
        match self.call(&Call::Gpus, CallTarget::Driver)? {
            Answer::Gpus { gpus } => Answer::gpus(gpus),
            other => Err(unexpected(&other)),
        }
    }

    /// None for a process that is gone, as the driver answers for one.
    fn state(&self, pid: i32) -> Result<Option<ProcessState>, CudaError> {
        if !crate::linux::proc::is_running(pid) {
            return Ok(None);
        }
        match self.call(&Call::State { pid: self.inside(pid)? }, CallTarget::Pid(pid))? {
            Answer::State { state } => Ok(state.map(ProcessState::from_raw)),
            other => Err(unexpected(&other)),
        }
    }

    fn lock(&self, pid: i32, timeout_ms: u32) -> Result<(), CudaError> {
        self.process_call(pid, |pid| Call::Lock { pid, timeout_ms })
    }

    fn checkpoint(&self, pid: i32) -> Result<(), CudaError> {
        self.process_call(pid, |pid| Call::Checkpoint { pid })
    }

    fn restore(&self, pid: i32, gpu_pairs: &[(GpuUuid, GpuUuid)]) -> Result<(), CudaError> {
        let pairs = gpu_pairs.iter().map(|(old, new)| (format_uuid(old), format_uuid(new))).collect();
        self.process_call(pid, |pid| Call::Restore { pid, pairs })
    }

    fn unlock(&self, pid: i32) -> Result<(), CudaError> {
        self.process_call(pid, |pid| Call::Unlock { pid })
    }
}
