//! Starting workloads under stasisd's management: own session and (unless asked otherwise)
//! own pid namespace under `stasis-init`, stdio to a log file in the state directory, own
//! cgroup (the last two: `home.rs`).

use std::fs::File;
use std::io::{Read, Seek, Write};
use std::os::fd::{AsRawFd, OwnedFd};
use std::os::unix::process::CommandExt;
use std::path::PathBuf;
use std::process::{Command, Stdio};

use nix::fcntl::OFlag;
use tracing::info;

use super::home::new_init_dir;
use super::workloads::{Workload, derived_name, is_container_name, valid_name};
use super::{Caller, Engine, RunError};
use crate::criu::support;
use crate::linux::sys::ChildSetup;

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
    /// Which pids it runs with.
    pub pids: Pids,
    /// Whom it runs as: a caller other than root gets a workload running as itself.
    pub caller: Caller,
}

/// The pids a workload runs with.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub enum Pids {
    /// A pid namespace of its own, except on a node where GPU checkpointing is available:
    /// CUDA fails to initialise (`CUDA_ERROR_OPERATING_SYSTEM`) in a pid namespace whose
    /// /proc is its parent's, as the driver looks itself up in /proc by its own pid.
    #[default]
    Default,
    /// stasisd's pid namespace.
    Host,
    /// A pid namespace of its own (under `stasis-init`), whatever the node.
    Own,
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
        let home = self.home(&name, params.caller, true).map_err(|(what, e)| setup_err(what)(e))?;
        let procs = (home.cgroup.as_deref())
            .map(|c| self.deps.host.open_cgroup_procs(c))
            .transpose()
            .map_err(setup_err("its cgroup"))?;
        let log = home.log.try_clone().map_err(setup_err("its log file"))?;
        let stdout = log.try_clone().map_err(setup_err("its log file"))?;
        let own_pids = match params.pids {
            Pids::Own => true,
            Pids::Host => false,
            Pids::Default => self.deps.gpu.is_none(),
        };
        if params.pids == Pids::Default && !own_pids {
            info!(workload = %name, "GPU node: the workload runs with stasisd's pids (CUDA needs them)");
        }
        let mut env = workload_env(&params);
        let no_rseq = support::rseq_dumpable(&self.deps.host.kernel_release()).is_err();
        if no_rseq {
            without_rseq(&mut env);
        }
        let init = own_pids
            .then(|| InitSetup::new(self.deps.host.init_program()?, &env))
            .transpose()
            .map_err(setup_err("its init"))?;
        let mut cmd = command_for(&params, &env, [stdout, log], init.as_ref(), no_rseq);
        let setup = ChildSetup {
            new_session: true,
            cgroup_procs: procs.iter().map(|f| f.as_raw_fd()).collect(),
            keep_fds: init.iter().flat_map(|i| [i.write.as_raw_fd(), i.env.as_raw_fd()]).collect(),
            new_pid_ns: own_pids,
        };
        let spawned = self.deps.host.spawn(&mut cmd, setup);
        // The reaper collects its exit status; nothing here waits for it.
        let pid = match (spawned, init) {
            (Err(source), init) => {
                init.into_iter().for_each(InitSetup::abandon);
                return Err(RunError::Spawn { program, source });
            }
            (Ok(pid), None) => pid,
            (Ok(_), Some(init)) => init.reported_pid().map_err(setup_err("its init"))?,
        };
        self.registry
            .put(Workload {
                name: name.clone(),
                pid,
                command: params.argv,
                managed: true,
                log_path: Some(home.log_path.clone()),
                cgroup: home.cgroup.clone(),
                idle_after_ms: params.idle_after.map(|d| d.as_millis() as u64),
                checkpoint_every_ms: params.checkpoint_every.map(|d| d.as_millis() as u64),
                owner_uid: params.caller.uid(),
                spot: params.spot,
                ..Default::default()
            })
            .map_err(setup_err("the workload registry"))?;
        info!(workload = %name, pid, "workload started");
        Ok(RunOutcome { workload: name, pid, log_path: home.log_path.clone() })
    }

    /// The name the new workload gets: the one asked for, if no live or reclaimed workload
    /// (or another user's) has it, or one derived from the program.
    fn free_name(&self, params: &RunParams, program: &str) -> Result<String, RunError> {
        let name = match &params.workload {
            Some(name) if valid_name(name) => name.clone(),
            Some(name) => return Err(RunError::BadName(name.clone())),
            None => derived_name(program, &format!("{:06x}", rand::random::<u32>() & 0xff_ffff)),
        };
        if params.caller != Caller::Root && is_container_name(&name) {
            return Err(RunError::ContainerName(name));
        }
        if let Some(existing) = self.registry.get(&name) {
            if !params.caller.owns(existing.owner_uid) {
                return Err(RunError::NameTaken(name));
            }
            if existing.reclaimed.is_some() {
                return Err(RunError::Reclaimed(name));
            }
            if self.deps.host.is_running(existing.pid) {
                return Err(RunError::AlreadyRunning { name, pid: existing.pid });
            }
        }
        Ok(name)
    }
}

/// What `stasis-init` is given: the pipe it reports the namespace init's pid on, the
/// command's environment (in a memory file, so that nothing of it is in the init's own
/// environment or command line), and the init's own working directory; and where it is.
struct InitSetup {
    read: OwnedFd,
    write: OwnedFd,
    env: File,
    dir: PathBuf,
    program: PathBuf,
}

impl InitSetup {
    fn new(program: PathBuf, env: &[(String, String)]) -> std::io::Result<Self> {
        let (read, write) = nix::unistd::pipe2(OFlag::O_CLOEXEC)?;
        let mut env_file = File::from(nix::sys::memfd::memfd_create(
            c"stasis-init-env",
            nix::sys::memfd::MFdFlags::MFD_CLOEXEC,
        )?);
        for (key, value) in env {
            env_file.write_all(format!("{key}={value}\0").as_bytes())?;
        }
        env_file.rewind()?;
        Ok(Self { read, write, env: env_file, dir: new_init_dir()?, program })
    }

    /// The pid `stasis-init` reports for the namespace's init (it writes it, then exits).
    fn reported_pid(self) -> std::io::Result<i32> {
        let Self { read, write, dir, .. } = self;
        drop(write);
        let mut text = String::new();
        let pid = File::from(read).read_to_string(&mut text).and_then(|_| {
            text.trim()
                .parse()
                .map_err(|_| std::io::Error::other(format!("stasis-init reported {text:?}, not a pid")))
        });
        if pid.is_err() {
            let _ = std::fs::remove_dir(&dir);
        }
        pid
    }

    /// Gives up the setup of an init that never started.
    fn abandon(self) {
        let _ = std::fs::remove_dir(&self.dir);
    }
}

/// The command that starts the workload: as the caller, stdin from /dev/null, stdout and
/// stderr to its log, in `env` and nothing of stasisd's environment. With `init`,
/// `stasis-init` starts it in a pid namespace of its own, and takes on the caller's ids only
/// for the command (the namespace is made as root). Nothing the caller chooses reaches code
/// that runs as root: stasis-init starts with an empty environment and in stasisd's working
/// directory, and the command's environment and directory are applied only to the command,
/// its directory after its ids are set (so a directory the caller may not enter fails the
/// start instead of being entered by root).
fn command_for(
    params: &RunParams,
    env: &[(String, String)],
    [stdout, stderr]: [File; 2],
    init: Option<&InitSetup>,
    no_rseq: bool,
) -> Command {
    let mut cmd = match init {
        None => {
            let mut cmd = Command::new(&params.argv[0]);
            if let Caller::User { uid, gid } = params.caller {
                // Its own uid and primary group; std drops root's supplementary groups with the
                // uid, and changes directory after the ids.
                cmd.uid(uid).gid(gid);
            }
            cmd.args(&params.argv[1..]).env_clear().envs(env.iter().map(|(k, v)| (k, v)));
            if let Some(cwd) = &params.cwd {
                cmd.current_dir(cwd);
            }
            cmd
        }
        Some(init) => {
            let mut cmd = Command::new(&init.program);
            cmd.env_clear();
            if no_rseq {
                // The init is in the tree too, and links glibc.
                cmd.env("GLIBC_TUNABLES", NO_RSEQ);
            }
            cmd.args(["--report-fd", &init.write.as_raw_fd().to_string()])
                .args(["--env-fd", &init.env.as_raw_fd().to_string()])
                .arg("--dir")
                .arg(&init.dir);
            if let Some(cwd) = &params.cwd {
                cmd.arg("--cwd").arg(cwd);
            }
            if let Caller::User { uid, gid } = params.caller {
                cmd.args(["--uid", &uid.to_string(), "--gid", &gid.to_string()]);
            }
            cmd.arg("--").args(&params.argv);
            cmd
        }
    };
    cmd.stdin(Stdio::null()).stdout(stdout).stderr(stderr);
    cmd
}

/// Where a workload's programs are looked for when stasisd has no PATH of its own.
const DEFAULT_PATH: &str = "/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin";

/// The environment a workload starts with. Never stasisd's own, which can hold the store's key
/// and credentials: stasisd's PATH, the HOME, USER and LOGNAME of whom the workload runs as,
/// then the variables the caller gave (which may replace those).
/// glibc's tunable that keeps it from registering restartable sequences.
const NO_RSEQ: &str = "glibc.pthread.rseq=0";

/// Asks glibc not to register restartable sequences (`glibc.pthread.rseq=0`), on kernels where
/// CRIU cannot dump a process that did (see `support::rseq_dumpable`); other tunables the
/// caller gave are kept, and a rseq setting of the caller's wins.
fn without_rseq(env: &mut Vec<(String, String)>) {
    match env.iter_mut().find(|(key, _)| key == "GLIBC_TUNABLES") {
        Some((_, value)) if value.contains("glibc.pthread.rseq=") => {}
        Some((_, value)) => *value = format!("{value}:{NO_RSEQ}"),
        None => env.push(("GLIBC_TUNABLES".into(), NO_RSEQ.into())),
    }
}

fn workload_env(params: &RunParams) -> Vec<(String, String)> {
    let path = std::env::var("PATH").unwrap_or_else(|_| DEFAULT_PATH.into());
    let mut env = vec![("PATH".to_string(), path)];
    if let Ok(Some(user)) = nix::unistd::User::from_uid(nix::unistd::Uid::from_raw(params.caller.uid())) {
        env.push(("HOME".into(), user.dir.to_string_lossy().into_owned()));
        env.push(("USER".into(), user.name.clone()));
        env.push(("LOGNAME".into(), user.name));
    }
    for (key, value) in &params.env {
        env.retain(|(k, _)| k != key);
        env.push((key.clone(), value.clone()));
    }
    env
}

#[cfg(test)]
mod tests {
    use super::without_rseq;

    fn env(pairs: &[(&str, &str)]) -> Vec<(String, String)> {
        pairs.iter().map(|(k, v)| (k.to_string(), v.to_string())).collect()
    }

    #[test]
    fn rseq_is_turned_off_keeping_the_callers_tunables() {
        let mut plain = env(&[("PATH", "/bin")]);
        without_rseq(&mut plain);
        assert_eq!(plain, env(&[("PATH", "/bin"), ("GLIBC_TUNABLES", "glibc.pthread.rseq=0")]));
        let mut other = env(&[("GLIBC_TUNABLES", "glibc.malloc.arena_max=2")]);
        without_rseq(&mut other);
        assert_eq!(other, env(&[("GLIBC_TUNABLES", "glibc.malloc.arena_max=2:glibc.pthread.rseq=0")]));
        let mut own = env(&[("GLIBC_TUNABLES", "glibc.pthread.rseq=1")]);
        without_rseq(&mut own);
        assert_eq!(own, env(&[("GLIBC_TUNABLES", "glibc.pthread.rseq=1")]));
    }
}
