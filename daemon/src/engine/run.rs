//! Starting workloads under stasisd's management: own session, stdio to a log file in the
//! state directory, own cgroup.

use std::fs::{File, OpenOptions};
use std::io::Read;
use std::os::fd::{AsRawFd, OwnedFd, RawFd};
use std::os::unix::fs::OpenOptionsExt;
use std::os::unix::process::CommandExt;
use std::path::{Path, PathBuf};
use std::process::{Command, Stdio};

use nix::fcntl::OFlag;
use tracing::info;

use super::workloads::{Workload, derived_name, valid_name};
use super::{Caller, Engine, RunError};
use crate::linux::cgroup::{WorkloadCgroup, v2_root};
use crate::linux::sys::{ChildSetup, spawn};

/// What to start.
#[derive(Debug, Clone, Default)]
pub struct RunParams {
    /// Name of the workload; derived from the command when `None`.
    pub workload: Option<String>,
    pub argv: Vec<String>,
    pub cwd: Option<PathBuf>,
    pub env: Vec<(String, String)>,
    /// Reclaim it after this long without activity (see `engine/idle/`).
    pub idle_after: Option<std::time::Duration>,
    /// Checkpoint it (left running) this often (see `engine/periodic.rs`).
    pub checkpoint_every: Option<std::time::Duration>,
    /// Evict it on a preemption notice (see `engine/evacuate/`).
    pub spot: bool,
    /// Run it in a pid namespace of its own, under `stasis-init`.
    pub own_pids: bool,
    /// Whom it runs as: a caller other than root gets a workload running as itself.
    pub caller: Caller,
}

/// A started workload.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct RunOutcome {
    pub workload: String,
    pub pid: i32,
    pub log_path: PathBuf,
}

impl Engine {
    /// Starts `params.argv` as a new managed workload.
    pub fn run(&self, params: RunParams) -> Result<RunOutcome, RunError> {
        let program = params.argv.first().ok_or(RunError::NoCommand)?.clone();
        let name = self.free_name(&params, &program)?;
        let setup_err = |what| {
            let workload = name.clone();
            move |source| RunError::Setup { workload, what, source }
        };
        let log_path = self.state.log_file(&name);
        let log = open_log(&log_path, params.caller).map_err(setup_err("its log file"))?;
        let cgroup = match v2_root() {
            Some(root) => Some(
                WorkloadCgroup::create(&root, self.store.node_tag(), &name)
                    .map_err(setup_err("its cgroup"))?,
            ),
            None => None,
        };
        let procs = cgroup.as_ref().map(|c| c.open_procs()).transpose().map_err(setup_err("its cgroup"))?;
        let stdout = log.try_clone().map_err(setup_err("its log file"))?;
        let report = match params.own_pids {
            true => Some(nix::unistd::pipe2(OFlag::O_CLOEXEC).map_err(|e| setup_err("its init")(e.into()))?),
            false => None,
        };
        let init = report.as_ref().map(|(_, w)| w.as_raw_fd());
        let mut cmd = command_for(&params, [stdout, log], init).map_err(setup_err("its init"))?;
        let setup = ChildSetup {
            new_session: true,
            cgroup_procs: procs.as_ref().map(|f| f.as_raw_fd()),
            keep_fds: init.into_iter().collect(),
            new_pid_ns: params.own_pids,
        };
        let child = spawn(&mut cmd, setup).map_err(|source| RunError::Spawn { program, source })?;
        // The reaper collects its exit status; nothing here waits for it.
        let pid = match report {
            None => child.id() as i32,
            Some((read, write)) => {
                drop(write);
                reported_pid(read).map_err(setup_err("its init"))?
            }
        };
        drop(child);
        self.registry
            .put(Workload {
                name: name.clone(),
                pid,
                command: params.argv,
                managed: true,
                log_path: Some(log_path.clone()),
                cgroup: cgroup.map(|c| c.path),
                idle_after_ms: params.idle_after.map(|d| d.as_millis() as u64),
                checkpoint_every_ms: params.checkpoint_every.map(|d| d.as_millis() as u64),
                owner_uid: params.caller.uid(),
                spot: params.spot,
                ..Default::default()
            })
            .map_err(setup_err("the workload registry"))?;
        info!(workload = %name, pid, "workload started");
        Ok(RunOutcome { workload: name, pid, log_path })
    }

    /// The name the new workload gets: the one asked for, if no live or reclaimed workload
    /// (or another user's) has it, or one derived from the program.
    fn free_name(&self, params: &RunParams, program: &str) -> Result<String, RunError> {
        let name = match &params.workload {
            Some(name) if valid_name(name) => name.clone(),
            Some(name) => return Err(RunError::BadName(name.clone())),
            None => derived_name(program, &format!("{:06x}", rand::random::<u32>() & 0xff_ffff)),
        };
        if let Some(existing) = self.registry.get(&name) {
            if !params.caller.owns(existing.owner_uid) {
                return Err(RunError::NameTaken(name));
            }
            if existing.reclaimed.is_some() {
                return Err(RunError::Reclaimed(name));
            }
            if self.host.is_running(existing.pid) {
                return Err(RunError::AlreadyRunning { name, pid: existing.pid });
            }
        }
        Ok(name)
    }
}

/// Opens (appending) the workload's log file, owned by whom the workload runs as.
fn open_log(path: &Path, caller: Caller) -> std::io::Result<File> {
    let log = OpenOptions::new().create(true).append(true).mode(0o600).open(path)?;
    if let Caller::User { uid, gid } = caller {
        std::os::unix::fs::fchown(&log, Some(uid), Some(gid))?;
    }
    Ok(log)
}

/// The command that starts the workload: as the caller, stdin from /dev/null, stdout and
/// stderr to its log. With `init` (the descriptor it reports on), `stasis-init` starts it in
/// a pid namespace of its own, and takes on the caller's ids only for the command (the
/// namespace is made as root).
fn command_for(
    params: &RunParams,
    [stdout, stderr]: [File; 2],
    init: Option<RawFd>,
) -> std::io::Result<Command> {
    let mut cmd = match init {
        None => {
            let mut cmd = Command::new(&params.argv[0]);
            if let Caller::User { uid, gid } = params.caller {
                // Its own uid and primary group; std drops root's supplementary groups with the uid.
                cmd.uid(uid).gid(gid);
            }
            cmd.args(&params.argv[1..]);
            cmd
        }
        Some(report) => {
            let mut cmd = Command::new(crate::linux::companion_program(INIT_BIN)?);
            cmd.args(["--report-fd", &report.to_string()]);
            if let Caller::User { uid, gid } = params.caller {
                cmd.args(["--uid", &uid.to_string(), "--gid", &gid.to_string()]);
            }
            cmd.arg("--").args(&params.argv);
            cmd
        }
    };
    cmd.envs(params.env.iter().map(|(k, v)| (k, v))).stdin(Stdio::null()).stdout(stdout).stderr(stderr);
    if let Some(cwd) = &params.cwd {
        cmd.current_dir(cwd);
    }
    Ok(cmd)
}

/// The program that starts a workload in a pid namespace of its own.
const INIT_BIN: &str = "stasis-init";

/// The pid `stasis-init` reports for the namespace's init (it writes it, then exits).
fn reported_pid(read: OwnedFd) -> std::io::Result<i32> {
    let mut text = String::new();
    File::from(read).read_to_string(&mut text)?;
    text.trim()
        .parse()
        .map_err(|_| std::io::Error::other(format!("stasis-init reported {text:?}, not a pid")))
}
