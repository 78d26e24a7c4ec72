//! Command-line arguments: clap structures only, no behaviour.

use std::path::PathBuf;

use clap::{ArgGroup, Args, Parser, Subcommand};

/// stasis: checkpoint and restore process trees managed by stasisd.
#[derive(Debug, Parser)]
#[command(name = "stasis", version)]
pub struct Cli {
    /// Path of stasisd's Unix socket.
    #[arg(
        long,
        global = true,
        value_name = "PATH",
        env = "STASIS_SOCKET",
        default_value = "/run/stasis/stasisd.sock"
    )]
    pub socket: PathBuf,

    #[command(subcommand)]
    pub command: Command,
}

#[derive(Debug, Subcommand)]
pub enum Command {
    /// Start a command as a workload managed by stasisd.
    Run(RunArgs),
    /// Checkpoint a process tree, by pid or by workload name.
    Checkpoint(CheckpointArgs),
    /// Restore a checkpoint, by id or the latest of a workload.
    Restore(RestoreArgs),
    /// List stored checkpoints.
    List(ListArgs),
    /// Show the details of one checkpoint.
    Show(ShowArgs),
    /// Delete a checkpoint.
    Delete(DeleteArgs),
    /// Show stasisd's version, configuration and workloads.
    Status(StatusArgs),
    /// Apply retention and reclaim store space no checkpoint references.
    Gc(GcArgs),
    /// Verify the store: every manifest, pack index and pack (with --read-data every chunk),
    /// and which checkpoints any damage breaks. Exits 1 when it finds a problem.
    Check(CheckArgs),
    /// Set or remove a workload's idle period: idle that long, it is checkpointed and
    /// stopped, and restored on its next use.
    Idle(IdleArgs),
    /// Restore a reclaimed (idle) workload now.
    Wake(WakeArgs),
    /// Set or stop a workload's periodic checkpoints (incremental, left running).
    Periodic(PeriodicArgs),
    /// Opt a workload in to (or out of) eviction when the cloud says the machine goes.
    Spot(SpotArgs),
    /// Make every spot workload durable now, shortest first, as a preemption notice does
    /// (evicted unless --leave-running). Root's alone.
    Evacuate(EvacuateArgs),
    /// Write a checkpoint as a container checkpoint archive (the layout of Podman's
    /// `container checkpoint --export` and the kubelet's checkpoint API). Root's alone.
    Export(ExportArgs),
    /// Take in a container checkpoint archive (Podman's, CRI-O's, containerd's or stasis')
    /// as a checkpoint of the store. Root's alone.
    Import(ImportArgs),
    /// Kubernetes containers, as the NRI plugin reports them (root's alone).
    #[command(subcommand)]
    Container(ContainerCommand),
}

#[derive(Debug, Subcommand)]
pub enum ContainerCommand {
    /// Record an opted-in container: its tree becomes the workload its identity names.
    Register(RegisterArgs),
    /// Forget a removed container (its workload keeps its checkpoints).
    Forget {
        /// The runtime's container id.
        id: String,
    },
}

#[derive(Debug, Args)]
pub struct RegisterArgs {
    /// The runtime's container id.
    #[arg(long)]
    pub id: String,
    /// The container's init process (stasis-pod), as this host numbers it.
    #[arg(long)]
    pub init_pid: i32,
    /// The image it runs (digest, or reference).
    #[arg(long)]
    pub image: String,
    /// The pod's namespace.
    #[arg(long)]
    pub namespace: String,
    /// The pod's owner: kind (StatefulSet, Job, Pod, ...) and name.
    #[arg(long)]
    pub owner_kind: String,
    #[arg(long)]
    pub owner_name: String,
    /// Which of the owner's pods (StatefulSet ordinal, Job completion index).
    #[arg(long, default_value = "")]
    pub ordinal: String,
    /// The container's name in the pod.
    #[arg(long)]
    pub container: String,
    /// A checkpoint this often, left running: 10m, 1h (a bare number is seconds).
    #[arg(long, value_name = "DURATION", value_parser = parse_duration)]
    pub checkpoint_every: Option<std::time::Duration>,
    /// Restore a checkpoint into it whatever image the checkpoint's container ran.
    #[arg(long)]
    pub any_image: bool,
    /// An NVIDIA GPU device file the container was given (/dev/nvidia0); once per GPU.
    #[arg(long, value_name = "PATH")]
    pub gpu_device: Vec<String>,
    /// Print the result as one JSON object.
    #[arg(long)]
    pub json: bool,
}

#[derive(Debug, Args)]
pub struct ExportArgs {
    /// Id of the checkpoint.
    pub id: String,
    /// The archive to write (it must not exist).
    #[arg(short, long, value_name = "FILE")]
    pub output: PathBuf,
    /// zstd, gzip or none.
    #[arg(long, default_value = "zstd")]
    pub compress: String,
    /// Print the result as one JSON object.
    #[arg(long)]
    pub json: bool,
}

#[derive(Debug, Args)]
pub struct ImportArgs {
    /// The archive: tar, gzip- or zstd-compressed.
    pub archive: PathBuf,
    /// The workload the checkpoint is of (by default the one the archive names).
    #[arg(long)]
    pub workload: Option<String>,
    /// Print the result as one JSON object.
    #[arg(long)]
    pub json: bool,
}

#[derive(Debug, Args)]
#[command(group(ArgGroup::new("switch").required(true).args(["on", "off"])))]
pub struct SpotArgs {
    /// The workload.
    pub workload: String,
    /// Evict it (checkpointed, then stopped) on a preemption notice.
    #[arg(long)]
    pub on: bool,
    /// Leave it alone on a preemption notice.
    #[arg(long)]
    pub off: bool,
}

#[derive(Debug, Args)]
pub struct EvacuateArgs {
    /// The time left before the machine goes: 30s, 2m (a bare number is seconds).
    #[arg(long, value_name = "DURATION", value_parser = parse_duration, default_value = "30s")]
    pub within: std::time::Duration,
    /// Checkpoint them and leave them running (to make a later eviction's delta small).
    #[arg(long)]
    pub leave_running: bool,
    /// Print the result as one JSON object.
    #[arg(long)]
    pub json: bool,
}

#[derive(Debug, Args)]
#[command(group(ArgGroup::new("interval").required(true).args(["every", "off"])))]
pub struct PeriodicArgs {
    /// The workload.
    pub workload: String,
    /// Checkpoint it this often: 90s, 10m, 1h (a bare number is seconds).
    #[arg(long, value_name = "DURATION", value_parser = parse_duration)]
    pub every: Option<std::time::Duration>,
    /// Stop its periodic checkpoints.
    #[arg(long)]
    pub off: bool,
}

#[derive(Debug, Args)]
#[command(group(ArgGroup::new("period").required(true).args(["after", "off"])))]
pub struct IdleArgs {
    /// The workload.
    pub workload: String,
    /// Reclaim it after this long without activity: 90s, 30m, 2h (a bare number is seconds).
    #[arg(long, value_name = "DURATION", value_parser = parse_duration)]
    pub after: Option<std::time::Duration>,
    /// Never reclaim it.
    #[arg(long)]
    pub off: bool,
}

#[derive(Debug, Args)]
pub struct WakeArgs {
    /// The reclaimed workload.
    pub workload: String,
    /// Print the result as one JSON object.
    #[arg(long)]
    pub json: bool,
}

#[derive(Debug, Args)]
pub struct CheckArgs {
    /// Also read every pack and verify every chunk's hash (reads the whole store).
    #[arg(long)]
    pub read_data: bool,
    /// Print the result as one JSON object.
    #[arg(long)]
    pub json: bool,
}

#[derive(Debug, Args)]
pub struct GcArgs {
    /// Keep this many newest checkpoints per workload and delete the older ones.
    #[arg(long, value_name = "N")]
    pub keep_last: Option<u32>,
    /// Print the result as one JSON object.
    #[arg(long)]
    pub json: bool,
}

#[derive(Debug, Args)]
pub struct RunArgs {
    /// Workload name; stasisd derives one from the command when omitted.
    #[arg(long, value_name = "NAME")]
    pub workload: Option<String>,
    /// Working directory of the command [default: the current directory].
    #[arg(long, value_name = "DIR")]
    pub cwd: Option<PathBuf>,
    /// Extra environment variable for the command; repeatable.
    #[arg(long, value_name = "KEY=VALUE", value_parser = parse_env_var)]
    pub env: Vec<String>,
    /// Reclaim the workload after this long without activity (checkpointed and stopped;
    /// restored on its next use): 90s, 30m, 2h (a bare number is seconds).
    #[arg(long, value_name = "DURATION", value_parser = parse_duration)]
    pub idle_after: Option<std::time::Duration>,
    /// Checkpoint the workload (left running, incremental) this often: 10m, 1h.
    #[arg(long, value_name = "DURATION", value_parser = parse_duration)]
    pub checkpoint_every: Option<std::time::Duration>,
    /// Evict the workload (checkpointed, then stopped) when the cloud says the machine goes,
    /// so another node can restore it (see `stasis spot`, `stasis evacuate`).
    #[arg(long)]
    pub spot: bool,
    /// Run it with pids of stasisd's pid namespace instead of a namespace of its own (under
    /// a small init, stasis-init): its checkpoints then restore only where those pids are
    /// free, and never as a second copy (`stasis restore --as`).
    #[arg(long, conflicts_with = "own_pids")]
    pub host_pids: bool,
    /// Run it in a pid namespace of its own even on a node with an NVIDIA driver (where the
    /// default is stasisd's pids: CUDA does not start in a pid namespace of its own).
    #[arg(long)]
    pub own_pids: bool,
    /// Print the result as one JSON object.
    #[arg(long)]
    pub json: bool,
    /// The command and its arguments, after `--`.
    #[arg(last = true, required = true, value_name = "CMD")]
    pub command: Vec<String>,
}

#[derive(Debug, Args)]
#[command(group(ArgGroup::new("target").required(true).args(["pid", "workload"])))]
pub struct CheckpointArgs {
    /// Pid of the root of the process tree to checkpoint.
    pub pid: Option<i32>,
    /// Checkpoint this workload's process tree instead of a pid.
    #[arg(long, value_name = "NAME")]
    pub workload: Option<String>,
    /// Keep the tree running after the checkpoint (it is stopped by default).
    #[arg(long)]
    pub leave_running: bool,
    /// Return once the tree is resumed (or stopped), before the checkpoint is durable.
    #[arg(long)]
    pub no_wait: bool,
    /// Print the result as one JSON object.
    #[arg(long)]
    pub json: bool,
}

#[derive(Debug, Args)]
#[command(group(ArgGroup::new("target").required(true).args(["checkpoint_id", "workload"])))]
pub struct RestoreArgs {
    /// Id of the checkpoint to restore.
    pub checkpoint_id: Option<String>,
    /// Restore the latest checkpoint of this workload instead of an id.
    #[arg(long, value_name = "NAME")]
    pub workload: Option<String>,
    /// Move GPU state to other GPUs: OLD-UUID=NEW-UUID, comma-separated or repeated. GPUs not
    /// named go to the same UUID, or else to a free GPU of the same model.
    #[arg(long, value_name = "OLD=NEW", value_delimiter = ',')]
    pub gpu_map: Vec<String>,
    /// Start the tree at once and bring its memory in from the store as it is touched (and
    /// the rest in the background).
    #[arg(long)]
    pub lazy: bool,
    /// With --lazy: return once the tree runs, before all of its memory is in.
    #[arg(long, requires = "lazy")]
    pub no_wait: bool,
    /// Restore established TCP connections closed instead of live: the workload's next use of
    /// them fails. Needed where their local addresses do not exist (on another node).
    #[arg(long)]
    pub tcp_close: bool,
    /// Restore it as workload NAME: another copy beside the one running (not for
    /// workloads run with --host-pids).
    #[arg(long = "as", value_name = "NAME")]
    pub as_workload: Option<String>,
    /// Print the result as one JSON object.
    #[arg(long)]
    pub json: bool,
}

#[derive(Debug, Args)]
pub struct ListArgs {
    /// Only list checkpoints of this workload.
    #[arg(long, value_name = "NAME")]
    pub workload: Option<String>,
    /// Print the result as one JSON object.
    #[arg(long)]
    pub json: bool,
}

#[derive(Debug, Args)]
pub struct ShowArgs {
    /// Id of the checkpoint.
    pub id: String,
    /// Print the result as one JSON object.
    #[arg(long)]
    pub json: bool,
}

#[derive(Debug, Args)]
pub struct DeleteArgs {
    /// Id of the checkpoint.
    pub id: String,
}

#[derive(Debug, Args)]
pub struct StatusArgs {
    /// Print the result as one JSON object.
    #[arg(long)]
    pub json: bool,
}

/// A duration as stasis reads them everywhere (`1h30m`, `1.5h`, `250ms`), or a bare number
/// of seconds; from 1 ms to a year.
fn parse_duration(s: &str) -> Result<std::time::Duration, String> {
    let duration = stasis_duration::parse_or_seconds(s).map_err(|e| e.to_string())?;
    let range = std::time::Duration::from_millis(1)..=std::time::Duration::from_secs(365 * 86_400);
    match range.contains(&duration) {
        true => Ok(duration),
        false => Err(format!("`{s}` is out of range (1ms to a year)")),
    }
}

/// Accepts `KEY=VALUE` with a non-empty key.
fn parse_env_var(s: &str) -> Result<String, String> {
    match s.split_once('=') {
        Some((key, _)) if !key.is_empty() => Ok(s.to_owned()),
        _ => Err(format!("expected KEY=VALUE, got `{s}`")),
    }
}

#[cfg(test)]
mod tests {
    use std::time::Duration;

    use clap::error::ErrorKind;

    use super::*;

    #[test]
    fn durations_take_units() {
        assert_eq!(parse_duration("90"), Ok(Duration::from_secs(90)));
        assert_eq!(parse_duration("30m"), Ok(Duration::from_secs(1800)));
        assert_eq!(parse_duration("1.5h"), Ok(Duration::from_secs(5400)));
        assert_eq!(parse_duration("250ms"), Ok(Duration::from_millis(250)));
        assert_eq!(parse_duration("1h30m"), Ok(Duration::from_secs(5400)), "as the pod annotations");
        assert!(parse_duration("5 days").is_err());
        assert!(parse_duration("0s").is_err());
        assert!(parse_duration("m").is_err());
    }

    #[test]
    fn idle_needs_a_period_or_off() {
        assert!(Cli::try_parse_from(["stasis", "idle", "w"]).is_err());
        assert!(Cli::try_parse_from(["stasis", "idle", "w", "--after", "1m", "--off"]).is_err());
        let cli = Cli::try_parse_from(["stasis", "idle", "w", "--after", "1m"]).unwrap();
        assert!(matches!(cli.command, Command::Idle(IdleArgs { after: Some(_), off: false, .. })));
    }

    fn parse(args: &[&str]) -> Result<Cli, clap::Error> {
        Cli::try_parse_from(std::iter::once("stasis").chain(args.iter().copied()))
    }

    fn command(args: &[&str]) -> Command {
        match parse(args) {
            Ok(cli) => cli.command,
            Err(e) => panic!("{args:?} should parse: {e}"),
        }
    }

    fn error_kind(args: &[&str]) -> ErrorKind {
        match parse(args) {
            Ok(cli) => panic!("{args:?} should not parse, got {cli:?}"),
            Err(e) => e.kind(),
        }
    }

    #[test]
    fn run_passes_everything_after_double_dash_to_the_command() {
        let args = "run --workload w --env A=1 --env B=x=y --json -- python -u --json train.py";
        let Command::Run(run) = command(&args.split(' ').collect::<Vec<_>>()) else {
            panic!("expected run");
        };
        assert_eq!(run.workload.as_deref(), Some("w"));
        assert_eq!(run.env, ["A=1", "B=x=y"]);
        assert!(run.json);
        assert_eq!(run.cwd, None);
        assert_eq!(run.command, ["python", "-u", "--json", "train.py"]);
    }

    #[test]
    fn run_requires_a_command_after_double_dash() {
        assert_eq!(error_kind(&["run", "--workload", "w"]), ErrorKind::MissingRequiredArgument);
        assert_eq!(error_kind(&["run", "sleep", "1"]), ErrorKind::UnknownArgument);
    }

    #[test]
    fn run_rejects_env_without_equals_or_key() {
        assert_eq!(error_kind(&["run", "--env", "NOPE", "--", "true"]), ErrorKind::ValueValidation);
        assert_eq!(error_kind(&["run", "--env", "=v", "--", "true"]), ErrorKind::ValueValidation);
    }

    #[test]
    fn checkpoint_takes_a_pid_or_a_workload_but_not_both() {
        let Command::Checkpoint(c) = command(&["checkpoint", "42", "--leave-running"]) else {
            panic!("expected checkpoint");
        };
        assert_eq!((c.pid, c.workload, c.leave_running), (Some(42), None, true));

        let Command::Checkpoint(c) = command(&["checkpoint", "--workload", "w", "--json"]) else {
            panic!("expected checkpoint");
        };
        assert_eq!((c.pid, c.workload.as_deref(), c.json), (None, Some("w"), true));

        assert_eq!(error_kind(&["checkpoint", "42", "--workload", "w"]), ErrorKind::ArgumentConflict);
        assert_eq!(error_kind(&["checkpoint", "--json"]), ErrorKind::MissingRequiredArgument);
        assert_eq!(error_kind(&["checkpoint", "abc"]), ErrorKind::ValueValidation);
    }

    #[test]
    fn restore_takes_an_id_or_a_workload_but_not_both() {
        let Command::Restore(r) = command(&["restore", "ck-1"]) else {
            panic!("expected restore");
        };
        assert_eq!((r.checkpoint_id.as_deref(), r.workload), (Some("ck-1"), None));

        assert_eq!(error_kind(&["restore", "ck-1", "--workload", "w"]), ErrorKind::ArgumentConflict);
        assert_eq!(error_kind(&["restore"]), ErrorKind::MissingRequiredArgument);
    }

    #[test]
    fn socket_flag_is_accepted_after_the_subcommand() {
        let cli = parse(&["status", "--socket", "/tmp/s.sock"]).map_err(|e| e.to_string());
        assert_eq!(cli.map(|c| c.socket), Ok(PathBuf::from("/tmp/s.sock")));
    }

    #[test]
    fn show_and_delete_require_an_id() {
        assert_eq!(error_kind(&["show", "--json"]), ErrorKind::MissingRequiredArgument);
        assert_eq!(error_kind(&["delete"]), ErrorKind::MissingRequiredArgument);
        let Command::Delete(d) = command(&["delete", "ck-1"]) else {
            panic!("expected delete");
        };
        assert_eq!(d.id, "ck-1");
    }
}
