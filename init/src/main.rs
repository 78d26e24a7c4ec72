//! stasis-init: the first process of a workload's own pid namespace (what `stasis run` starts, unless --host-pids).
//!
//! stasisd starts it with a new pid namespace unshared for its children. It forks once: the
//! child is pid 1 of the new namespace, and this process reports that child's pid (as stasisd
//! sees it) on the descriptor `--report-fd`, then exits. The child leads a session of its own
//! (CRIU records sessions only inside the namespace), starts the workload's command (as
//! `--uid`/`--gid` when given), forwards the signals a process gets asked to stop or report
//! with to it, reaps whatever the namespace orphans, and exits as the command did.
//!
//! Once the command runs, the init moves into `--dir`, a directory of its own: CRIU's code
//! injected into a namespace's init mounts a /proc for the namespace in a directory it makes
//! in the init's working directory, so that directory must be writable and not shared with
//! another workload's init that CRIU may be dumping at the same moment. The init removes it
//! when it exits.
//!
//! Because the tree's processes are numbered inside the namespace, a checkpoint of it can be
//! restored anywhere, as often as wanted: each copy gets a namespace of its own.
#![deny(unsafe_code)]

use std::io::Write;
use std::os::unix::process::CommandExt;
use std::process::{Command, ExitCode};

use anyhow::Context;
use clap::Parser;
use nix::unistd::Pid;
use stasis_init::supervise::{handle_signals, supervise};
use stasis_init::sys::{Forked, fork, take_inherited_fd};

/// Runs a workload as the init of its own pid namespace (started by stasisd, not by hand).
#[derive(Debug, Parser)]
#[command(version, about)]
struct Args {
    /// Where to write the namespace init's pid, as the starting side sees it.
    #[arg(long)]
    report_fd: i32,
    #[arg(long)]
    uid: Option<u32>,
    #[arg(long)]
    gid: Option<u32>,
    /// The init's own working directory (the command keeps the one it was started in).
    #[arg(long)]
    dir: std::path::PathBuf,
    /// The command and its arguments.
    #[arg(last = true, required = true)]
    command: Vec<String>,
}

fn main() -> anyhow::Result<ExitCode> {
    let args = Args::parse();
    let report = take_inherited_fd(args.report_fd).context("the report descriptor")?;
    match fork().context("forking the namespace's init")? {
        Forked::Parent(child) => {
            let mut report = std::fs::File::from(report);
            writeln!(report, "{child}").context("reporting the init's pid")?;
            Ok(ExitCode::SUCCESS)
        }
        Forked::Child => {
            drop(report);
            let status = init(&args);
            let _ = std::fs::remove_dir(&args.dir);
            status
        }
    }
}

/// Pid 1 of the namespace: starts the command, forwards signals, reaps, exits as the command.
fn init(args: &Args) -> anyhow::Result<ExitCode> {
    nix::unistd::setsid().context("starting a session")?;
    let mut signals = handle_signals()?;
    let mut cmd = Command::new(&args.command[0]);
    cmd.args(&args.command[1..]);
    if let Some(gid) = args.gid {
        cmd.gid(gid);
    }
    if let Some(uid) = args.uid {
        cmd.uid(uid);
    }
    let workload = cmd.spawn().with_context(|| format!("starting {}", args.command[0]))?;
    let workload = Pid::from_raw(workload.id() as i32);
    std::env::set_current_dir(&args.dir).with_context(|| format!("moving into {}", args.dir.display()))?;
    Ok(supervise(workload, &mut signals))
}
