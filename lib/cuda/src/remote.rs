//! The driver calls stasisd makes on the processes of a container, run inside the container.
//!
//! A container's CUDA processes use the driver library the container was given (the NVIDIA
//! container toolkit mounts the node's), see only the container's GPU device files, and are
//! numbered in the container's pid namespace. So stasisd does not call its own driver for
//! them: it runs a helper (its own `stasis-pod cuda CALL`) in the container's namespaces for
//! each call, with pids as the container numbers them. The helper loads the node's driver
//! library, initialises it in the container's root, makes the one call and prints the
//! [`Answer`] as one JSON line (the daemon's `engine/host/container_cuda.rs` runs it).
//!
//! This module is both sides' part that is not process handling: the [`Call`] and [`Answer`]
//! (serde, JSON), [`serve`] (the helper's side, over any [`GpuCheckpointer`]) and
//! [`Answer::into_result`] (stasisd's side, back into the driver's own errors).

use serde::{Deserialize, Serialize};

use super::{CallTarget, CudaError, GpuCheckpointer, GpuInfo, ProcessState, format_uuid, parse_uuid};

/// One driver call, with pids as the container numbers them.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "snake_case", tag = "call")]
pub enum Call {
    Version,
    Gpus,
    State {
        pid: i32,
    },
    Lock {
        pid: i32,
        timeout_ms: u32,
    },
    Checkpoint {
        pid: i32,
    },
    /// GPU pairs as `GPU-…` UUID strings: (checkpoint's, target's).
    Restore {
        pid: i32,
        pairs: Vec<(String, String)>,
    },
    Unlock {
        pid: i32,
    },
}

/// One GPU the driver inside the container sees.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct RemoteGpu {
    pub index: u32,
    pub uuid: String,
    pub name: String,
    pub total_memory: u64,
}

/// What the helper answers.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "snake_case", tag = "answer")]
pub enum Answer {
    Done,
    Version {
        version: i32,
    },
    Gpus {
        gpus: Vec<RemoteGpu>,
    },
    /// The raw `CUprocessState`; none when the process has no CUDA state.
    State {
        state: Option<i32>,
    },
    /// A driver call failed (`code` is its `CUresult`, `name` the driver's name for it), or
    /// the driver could not be used (no `code`); `message` is the whole error, its causes
    /// included.
    Failed {
        call: Option<String>,
        code: Option<u32>,
        name: Option<String>,
        message: String,
    },
}

/// Makes `call` on `driver` (or reports why there is none): the helper's side.
pub fn serve(driver: Result<&dyn GpuCheckpointer, &CudaError>, call: &Call) -> Answer {
    let driver = match driver {
        Ok(d) => d,
        Err(e) => return failed(e),
    };
    let done = |r: Result<(), CudaError>| r.map_or_else(|e| failed(&e), |()| Answer::Done);
    match call {
        Call::Version => Answer::Version { version: driver.driver_version() },
        Call::Gpus => match driver.gpus() {
            Ok(gpus) => Answer::Gpus { gpus: gpus.iter().map(remote_gpu).collect() },
            Err(e) => failed(&e),
        },
        Call::State { pid } => match driver.state(*pid) {
            Ok(state) => Answer::State { state: state.map(ProcessState::raw) },
            Err(e) => failed(&e),
        },
        Call::Lock { pid, timeout_ms } => done(driver.lock(*pid, *timeout_ms)),
        Call::Checkpoint { pid } => done(driver.checkpoint(*pid)),
        Call::Restore { pid, pairs } => {
            let parsed: Result<Vec<_>, CudaError> =
                pairs.iter().map(|(old, new)| Ok((parse_uuid(old)?, parse_uuid(new)?))).collect();
            done(parsed.and_then(|pairs| driver.restore(*pid, &pairs)))
        }
        Call::Unlock { pid } => done(driver.unlock(*pid)),
    }
}

fn remote_gpu(g: &GpuInfo) -> RemoteGpu {
    RemoteGpu {
        index: g.index,
        uuid: format_uuid(&g.uuid),
        name: g.name.clone(),
        total_memory: g.total_memory,
    }
}

fn failed(e: &CudaError) -> Answer {
    let (call, name) = match e {
        CudaError::Call { call, name, .. } => (Some((*call).to_owned()), Some(name.clone())),
        _ => (None, None),
    };
    Answer::Failed { call, code: e.code(), name, message: stasis_errors::error_chain(e) }
}

/// The driver calls a helper may name, as `'static` names for [`CudaError::Call`].
const CALLS: [&str; 11] = [
    "cuInit",
    "cuDriverGetVersion",
    "cuDeviceGetCount",
    "cuDeviceGet",
    "cuDeviceGetName",
    "cuDeviceGetUuid_v2",
    "cuDeviceTotalMem_v2",
    "cuCheckpointProcessLock",
    "cuCheckpointProcessCheckpoint",
    "cuCheckpointProcessRestore",
    "cuCheckpointProcessUnlock",
];
const GET_STATE: &str = "cuCheckpointProcessGetState";

impl Answer {
    /// The answer to a call about `target` (a pid as stasisd numbers it, for messages), as
    /// the driver's own result would be: a failed driver call keeps its code, so that
    /// [`CudaError::is_lock_timeout`] and the like still tell what happened.
    pub fn into_result(self, target: CallTarget) -> Result<Self, CudaError> {
        match self {
            Self::Failed { call, code: Some(code), name, message } => {
                match call.and_then(|c| CALLS.iter().chain([&GET_STATE]).find(|k| **k == c)) {
                    Some(call) => Err(CudaError::call_named(call, target, code, name)),
                    None => Err(CudaError::InContainer { message }),
                }
            }
            Self::Failed { message, .. } => Err(CudaError::InContainer { message }),
            other => Ok(other),
        }
    }

    /// The answer a helper printed on stdout (its last line), or why there is none.
    pub fn from_output(stdout: &str) -> Result<Self, CudaError> {
        let line = stdout.lines().rev().find(|l| !l.trim().is_empty()).unwrap_or_default();
        serde_json::from_str(line).map_err(|e| CudaError::InContainer {
            message: format!("the helper's answer {line:?} is not one: {e}"),
        })
    }

    /// The GPUs of a [`Answer::Gpus`].
    pub fn gpus(gpus: Vec<RemoteGpu>) -> Result<Vec<GpuInfo>, CudaError> {
        gpus.into_iter()
            .map(|g| {
                Ok(GpuInfo {
                    index: g.index,
                    uuid: parse_uuid(&g.uuid)?,
                    name: g.name,
                    total_memory: g.total_memory,
                })
            })
            .collect()
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::code;
    use crate::fake::FakeGpu;

    #[test]
    fn calls_and_answers_travel_as_one_json_line() {
        let call = Call::Restore { pid: 7, pairs: vec![("GPU-a".into(), "GPU-b".into())] };
        let text = serde_json::to_string(&call).unwrap();
        assert!(!text.contains('\n'));
        assert_eq!(serde_json::from_str::<Call>(&text).unwrap(), call);
        let answer = Answer::State { state: Some(2) };
        let printed = format!("a driver's warning\n{}\n", serde_json::to_string(&answer).unwrap());
        assert_eq!(Answer::from_output(&printed).unwrap(), answer);
        assert!(Answer::from_output("").is_err(), "no answer is an error, not a success");
    }

    #[test]
    fn the_helper_makes_the_call_on_its_driver() {
        let fake = FakeGpu::default();
        assert_eq!(serve(Ok(&fake), &Call::Lock { pid: 3, timeout_ms: 10 }), Answer::Done);
        assert_eq!(serve(Ok(&fake), &Call::State { pid: 3 }), Answer::State { state: Some(1) });
        let uuid = "GPU-00000000-0000-0000-0000-000000000001".to_owned();
        let restore = Call::Restore { pid: 3, pairs: vec![(uuid.clone(), uuid)] };
        assert_eq!(serve(Ok(&fake), &restore), Answer::Done);
        assert_eq!(fake.calls(), ["lock 3", "restore 3"]);
    }

    #[test]
    fn a_failed_call_keeps_its_code_across_the_container() {
        let fake = FakeGpu { fail_checkpoint_of: Some(3), ..Default::default() };
        let answer = serve(Ok(&fake), &Call::Checkpoint { pid: 3 });
        assert!(matches!(answer, Answer::Failed { code: None, .. }), "{answer:?}");

        let timeout = Answer::Failed {
            call: Some("cuCheckpointProcessLock".into()),
            code: Some(code::CUDA_ERROR_NOT_READY),
            name: Some("CUDA_ERROR_NOT_READY".into()),
            message: "timed out".into(),
        };
        let err = timeout.into_result(CallTarget::Pid(4321)).unwrap_err();
        assert!(err.is_lock_timeout(), "{err}");
        assert_eq!(err.to_string(), "cuCheckpointProcessLock(pid 4321) failed: CUDA_ERROR_NOT_READY (600)");

        let none = serve(Err(&CudaError::Unsupported { reason: "old".into() }), &Call::Gpus);
        let err = none.into_result(CallTarget::Driver).unwrap_err();
        assert_eq!(err.to_string(), "inside the container: CUDA checkpointing is not supported here: old");
    }
}
