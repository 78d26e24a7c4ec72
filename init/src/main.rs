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
//! stasisd starts it as root, with an empty environment: the command's environment comes on
//! `--env-fd` (a memory file of `KEY=VALUE` entries, each ended by a NUL) and its working
//! directory as `--cwd`, and both are applied to the command alone, the directory after its
//! ids are set. Nothing the caller chose runs, or is looked at, as root.
//!
//! Because the tree's processes are numbered inside the namespace, a checkpoint of it can be
//! restored anywhere, as often as wanted: each copy gets a namespace of its own.
#![deny(unsafe_code)]

use std::io::{Read, Write};
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
    /// The init's own working directory.
    #[arg(long)]
    dir: std::path::PathBuf,
    /// A descriptor to read the command's environment from (`KEY=VALUE`, each ended by a NUL).
    #[arg(long)]
    env_fd: Option<i32>,
    /// The command's working directory, entered as the command's user.
    #[arg(long)]
    cwd: Option<std::path::PathBuf>,
    /// The command and its arguments.
    #[arg(last = true, required = true)]
    command: Vec<String>,
}

fn main() -> anyhow::Result<ExitCode> {
    let args = Args::parse();
    let report = take_inherited_fd(args.report_fd).context("the report descriptor")?;
    let env = args.env_fd.map(read_env).transpose().context("the environment descriptor")?;
    match fork().context("forking the namespace's init")? {
        Forked::Parent(child) => {
            let mut report = std::fs::File::from(report);
            writeln!(report, "{child}").context("reporting the init's pid")?;
            Ok(ExitCode::SUCCESS)
        }
        Forked::Child => {
            drop(report);
            let status = init(&args, env.as_deref());
            let _ = std::fs::remove_dir(&args.dir);
            status
        }
    }
}

/// The command's environment: the entries of descriptor `fd`.
fn read_env(fd: i32) -> anyhow::Result<Vec<(String, String)>> {
    let mut text = Vec::new();
    std::fs::File::from(take_inherited_fd(fd)?).read_to_end(&mut text)?;
    parse_env(&text)
}

/// `KEY=VALUE` entries, each ended by a NUL.
fn parse_env(text: &[u8]) -> anyhow::Result<Vec<(String, String)>> {
    text.split(|b| *b == 0)
        .filter(|entry| !entry.is_empty())
        .map(|entry| {
            let entry = std::str::from_utf8(entry).context("an environment entry is not UTF-8")?;
            let (key, value) = entry.split_once('=').filter(|(k, _)| !k.is_empty()).with_context(|| {
                format!("environment entry {:?} is not KEY=VALUE", entry.chars().take(40).collect::<String>())
            })?;
            Ok((key.to_string(), value.to_string()))
        })
        .collect()
}

/// Pid 1 of the namespace: starts the command, forwards signals, reaps, exits as the command.
fn init(args: &Args, env: Option<&[(String, String)]>) -> anyhow::Result<ExitCode> {
    nix::unistd::setsid().context("starting a session")?;
    let mut signals = handle_signals()?;
    let mut cmd = Command::new(&args.command[0]);
    cmd.args(&args.command[1..]);
    if let Some(env) = env {
        cmd.env_clear().envs(env.iter().map(|(k, v)| (k, v)));
    }
    // std enters the directory after setting the ids below, so as the command's user.
    if let Some(cwd) = &args.cwd {
        cmd.current_dir(cwd);
    }
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

#[cfg(test)]
mod tests {
    use super::parse_env;

    #[test]
    fn environment_entries_are_nul_ended_key_value_pairs() {
        let env = parse_env(b"PATH=/usr/bin\0A=x=y\0EMPTY=\0").unwrap();
        assert_eq!(
            env,
            [("PATH", "/usr/bin"), ("A", "x=y"), ("EMPTY", "")].map(|(k, v)| (k.into(), v.into()))
        );
        assert!(parse_env(b"").unwrap().is_empty());
        assert!(parse_env(b"NOEQUALS\0").is_err());
        assert!(parse_env(b"=v\0").is_err());
        assert!(parse_env(b"K=\xff\0").is_err());
    }
}
