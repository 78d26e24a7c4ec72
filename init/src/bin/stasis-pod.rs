//! stasis-pod: the first process of a Kubernetes container that opted in to stasis, and its
//! preStop hook.
//!
//! `stasis-pod run -- COMMAND...` is the container's command (the webhook wraps the original
//! one). It asks stasisd, through the pod endpoint mounted into the container, whether a
//! checkpoint of this container's identity waits. If none does, it starts the command as its
//! child, in a session of its own; if one does, stasisd restores the checkpointed tree into
//! the container as its child. Either way it then passes on the signals meant for the
//! workload, reaps orphans, and exits as the workload did.
//!
//! When the workload was evicted, the init waits for the kubelet's SIGTERM and exits 0.
//!
//! `stasis-pod prestop` is the container's preStop hook: it asks stasisd to checkpoint the
//! container's tree for eviction and returns once the checkpoint is durable (the tree is gone
//! then) or has failed (the tree runs on, and is stopped as usual). `stasis-pod ready` is its
//! startup probe: it succeeds once the workload runs.
//!
//! `stasis-pod cuda --root DIR CALL` is not for the container: stasisd runs its own copy in
//! the container's namespaces, from its own root directory, to make one CUDA driver call on the
//! container's processes (`stasis_cuda::remote`). It loads the node's driver library, which
//! stasisd opened and hands over as standard input, then moves into the container's root `DIR`
//! and only there initialises the driver, which so sees the container's devices and files:
//! nothing of the container's image is loaded or run as code.
#![deny(unsafe_code)]

use std::io::{BufRead, BufReader, Write};
use std::os::unix::net::UnixStream;
use std::path::{Path, PathBuf};
use std::process::{Command, ExitCode};
use std::time::{Duration, Instant};

use anyhow::{Context, bail};
use clap::{Parser, Subcommand};
use nix::unistd::Pid;
use serde_json::Value;
use stasis_cuda::{CudaDriver, GpuCheckpointer, remote};
use stasis_init::supervise::{handle_signals, supervise};
use stasis_init::sys::{forbid_exec, own_session};

#[derive(Debug, Parser)]
#[command(version, about)]
struct Args {
    /// The pod endpoint's socket, as mounted into the container.
    #[arg(long, env = "STASIS_POD_SOCKET", default_value = "/.stasis-run/pod.sock")]
    socket: PathBuf,
    #[command(subcommand)]
    command: Mode,
}

#[derive(Debug, Subcommand)]
enum Mode {
    /// Be the container's init: restore its checkpointed workload, or start COMMAND.
    Run {
        #[arg(last = true, required = true)]
        command: Vec<String>,
    },
    /// Checkpoint this container's workload for eviction (the preStop hook). With the grace
    /// period (STASIS_GRACE_SECONDS, which the webhook sets), an eviction that would not be
    /// durable in time is not tried.
    Prestop {
        #[arg(long, env = "STASIS_GRACE_SECONDS")]
        grace_seconds: Option<u64>,
    },
    /// Exit 0 once the workload runs (the startup probe): started, or restored.
    Ready,
    /// Make one CUDA driver call (JSON, see stasis_cuda::remote) with the driver library open
    /// as standard input, initialised in root directory ROOT, and print the answer as one
    /// JSON line (run by stasisd). The helper may start no program.
    #[command(hide = true)]
    Cuda {
        #[arg(long)]
        root: PathBuf,
        call: String,
    },
}

/// How long a starting container waits for stasisd's endpoint to answer at all.
const ENDPOINT_WAIT: Duration = Duration::from_secs(30);

fn main() -> anyhow::Result<ExitCode> {
    let args = Args::parse();
    match args.command {
        Mode::Run { command } => run(&args.socket, &command),
        Mode::Prestop { grace_seconds } => prestop(&args.socket, grace_seconds),
        Mode::Ready => {
            let answer = ask(&args.socket, serde_json::json!({ "op": "ready" }), Duration::ZERO)?;
            Ok(if answer["ready"] == true { ExitCode::SUCCESS } else { ExitCode::FAILURE })
        }
        Mode::Cuda { root, call } => cuda(&root, &call),
    }
}

/// Where the driver library stasisd hands over is open.
const HANDED_LIBRARY: &str = "/proc/self/fd/0";

fn cuda(root: &Path, call: &str) -> anyhow::Result<ExitCode> {
    let call: remote::Call =
        serde_json::from_str(call).with_context(|| format!("a malformed call: {call}"))?;
    let in_container = |message: String| stasis_cuda::CudaError::InContainer { message };
    // Nothing this process starts could be trusted once it is in the container's root: a
    // program there (the driver may run `nvidia-modprobe`) would be the image's, run as root.
    let driver = forbid_exec()
        .map_err(|e| in_container(format!("forbidding this helper to start programs: {e}")))
        .and_then(|()| CudaDriver::open(HANDED_LIBRARY))
        .and_then(|open| {
            enter_root(root).map_err(|e| {
                in_container(format!("entering the container's root {}: {e}", root.display()))
            })?;
            open.init()
        });
    let answer = remote::serve(driver.as_ref().map(|d| d as &dyn GpuCheckpointer), &call);
    println!("{}", serde_json::to_string(&answer)?);
    Ok(ExitCode::SUCCESS)
}

fn run(socket: &Path, command: &[String]) -> anyhow::Result<ExitCode> {
    let mut signals = handle_signals()?;
    let answer = match socket.exists() {
        // Not opted in here (no endpoint mounted): just the command.
        false => {
            eprintln!("stasis-pod: no stasis endpoint at {}; running without checkpoints", socket.display());
            serde_json::json!({ "action": "fresh" })
        }
        true => ask(socket, serde_json::json!({ "op": "start" }), ENDPOINT_WAIT)?,
    };
    let workload = match answer["action"].as_str() {
        Some("restored") => {
            let pid = answer["pid"].as_i64().context("a restore answer without a pid")?;
            eprintln!("stasis-pod: restored from checkpoint {}", answer["checkpoint"]);
            Pid::from_raw(pid as i32)
        }
        Some("fresh") => {
            let mut cmd = Command::new(&command[0]);
            cmd.args(&command[1..]);
            own_session(&mut cmd);
            let child = cmd.spawn().with_context(|| format!("starting {}", command[0]))?;
            Pid::from_raw(child.id() as i32)
        }
        _ => bail!("stasisd could not start this container: {}", answer["error"]),
    };
    let status = supervise(workload, &mut signals);
    eprintln!("stasis-pod: the workload ended ({status:?})");
    // An evicted workload is gone before the kubelet stops the container: the init stays
    // until then, so that the preStop hook (a process of this container) gets its answer.
    let ended = serde_json::json!({ "op": "ended" });
    if socket.exists() && ask(socket, ended, Duration::ZERO).is_ok_and(|a| a["evicted"] == true) {
        eprintln!("stasis-pod: the workload was evicted; waiting to be stopped");
        let stop = [nix::sys::signal::Signal::SIGTERM as i32, nix::sys::signal::Signal::SIGINT as i32];
        signals.forever().find(|s| stop.contains(s));
        return Ok(ExitCode::SUCCESS);
    }
    Ok(status)
}

/// Seconds of the grace period the eviction leaves to the kubelet's SIGTERM and the rest.
const STOP_MARGIN_SECS: u64 = 5;

fn prestop(socket: &Path, grace_seconds: Option<u64>) -> anyhow::Result<ExitCode> {
    let mut request = serde_json::json!({ "op": "evict" });
    if let Some(grace) = grace_seconds {
        request["within_ms"] = (grace.saturating_sub(STOP_MARGIN_SECS) * 1000).into();
    }
    let answer = ask(socket, request, Duration::ZERO)?;
    match answer["checkpoint"].as_str() {
        Some(id) => {
            println!("stasis-pod: checkpoint {id} is durable");
            Ok(ExitCode::SUCCESS)
        }
        None => {
            eprintln!("stasis-pod: no checkpoint: {}", answer["error"]);
            Ok(ExitCode::FAILURE)
        }
    }
}

/// Makes `root` this process's root directory and working directory.
fn enter_root(root: &Path) -> nix::Result<()> {
    nix::unistd::chroot(root)?;
    nix::unistd::chdir("/")
}

/// Sends `request` to the pod endpoint and returns its answer; retries connecting for up to
/// `wait` (stasisd restarting).
fn ask(socket: &Path, request: Value, wait: Duration) -> anyhow::Result<Value> {
    let deadline = Instant::now() + wait;
    let mut stream = loop {
        match UnixStream::connect(socket) {
            Ok(stream) => break stream,
            Err(e) if Instant::now() < deadline => {
                eprintln!("stasis-pod: waiting for stasisd ({e})");
                std::thread::sleep(Duration::from_secs(1));
            }
            Err(e) => return Err(e).with_context(|| format!("connecting to {}", socket.display())),
        }
    };
    writeln!(stream, "{request}").context("sending the request")?;
    let mut line = String::new();
    BufReader::new(stream).read_line(&mut line).context("reading the answer")?;
    serde_json::from_str(&line).with_context(|| format!("a malformed answer: {line:?}"))
}
