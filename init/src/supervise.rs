//! Pid 1's duties once its workload runs.

use std::process::ExitCode;

use anyhow::Context;
use nix::sys::signal::{Signal, kill};
use nix::sys::wait::{WaitPidFlag, WaitStatus, waitpid};
use nix::unistd::Pid;
use signal_hook::iterator::Signals;

/// Signals passed on to the workload.
const FORWARDED: [Signal; 8] = [
    Signal::SIGHUP,
    Signal::SIGINT,
    Signal::SIGQUIT,
    Signal::SIGTERM,
    Signal::SIGUSR1,
    Signal::SIGUSR2,
    Signal::SIGWINCH,
    Signal::SIGCONT,
];

/// Handles the forwarded signals and SIGCHLD; call before the workload starts, so that none
/// is missed. Handlers, not a blocked mask: the kernel passes a signal from outside the
/// namespace to its init only if the init handles it.
pub fn handle_signals() -> anyhow::Result<Signals> {
    let handled: Vec<i32> = FORWARDED.iter().chain([&Signal::SIGCHLD]).map(|s| *s as i32).collect();
    Signals::new(&handled).context("handling signals")
}

/// Forwards signals to `workload` and reaps every child until `workload` ends; returns its
/// exit status (128 + the signal that killed it).
pub fn supervise(workload: Pid, signals: &mut Signals) -> ExitCode {
    loop {
        // A child that ended before the handler saw its SIGCHLD is reaped here too.
        while let Ok(status) = waitpid(None, Some(WaitPidFlag::WNOHANG)) {
            match status {
                WaitStatus::Exited(pid, code) if pid == workload => return ExitCode::from(code as u8),
                WaitStatus::Signaled(pid, signal, _) if pid == workload => {
                    return ExitCode::from(128 + signal as u8);
                }
                WaitStatus::StillAlive => break,
                _ => {}
            }
        }
        for signal in signals.wait() {
            match Signal::try_from(signal) {
                Ok(Signal::SIGCHLD) | Err(_) => {}
                Ok(signal) => {
                    let _ = kill(workload, signal);
                }
            }
        }
    }
}
