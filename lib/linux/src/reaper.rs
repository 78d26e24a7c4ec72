//! stasisd is a child subreaper: it adopts the trees CRIU restores and the orphans of the
//! workloads it starts, and it alone reaps children (`waitpid(-1)`), so no exited workload
//! lingers as a zombie holding a pid that a restore needs.
//!
//! Because every child is reaped here, nothing else in the daemon may `wait` for a child.

use std::collections::HashMap;
use std::os::fd::{AsFd, OwnedFd};
use std::sync::{Arc, Mutex};
use std::time::Duration;

use nix::errno::Errno;
use nix::poll::{PollFd, PollFlags, PollTimeout, poll};
use nix::sys::wait::{WaitPidFlag, WaitStatus, waitpid};
use nix::unistd::Pid;
use tokio::signal::unix::{SignalKind, signal};
use tokio::sync::Notify;
use tracing::{debug, info};

use super::proc::ProcStat;

/// How a child ended.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum ExitKind {
    Exited(i32),
    Signaled(i32),
}

impl std::fmt::Display for ExitKind {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            Self::Exited(code) => write!(f, "exit status {code}"),
            Self::Signaled(signal) => write!(f, "signal {signal}"),
        }
    }
}

/// Collects the exit of every child of stasisd.
#[derive(Debug, Default, Clone)]
pub struct Reaper {
    inner: Arc<ReaperInner>,
}

#[derive(Debug, Default)]
struct ReaperInner {
    exits: Mutex<HashMap<i32, ExitKind>>,
    changed: Notify,
    /// Set by [`Reaper::start`]: a default `Reaper` (for tests of code that takes one) reaps
    /// nothing, so it cannot take the exit of a child someone else waits for.
    reaping: std::sync::atomic::AtomicBool,
}

impl Reaper {
    /// Makes this process a child subreaper and starts reaping on SIGCHLD.
    pub fn start() -> std::io::Result<Self> {
        nix::sys::prctl::set_child_subreaper(true).map_err(std::io::Error::from)?;
        let reaper = Self::default();
        reaper.inner.reaping.store(true, std::sync::atomic::Ordering::Relaxed);
        let mut sigchld = signal(SignalKind::child())?;
        let this = reaper.clone();
        tokio::spawn(async move {
            loop {
                this.reap_all();
                // A periodic sweep as well: signals coalesce and may race with our start.
                let _ = tokio::time::timeout(Duration::from_secs(1), sigchld.recv()).await;
            }
        });
        Ok(reaper)
    }

    fn reap_all(&self) {
        if !self.inner.reaping.load(std::sync::atomic::Ordering::Relaxed) {
            return;
        }
        loop {
            match waitpid(Pid::from_raw(-1), Some(WaitPidFlag::WNOHANG)) {
                Ok(WaitStatus::Exited(pid, code)) => self.record(pid.as_raw(), ExitKind::Exited(code)),
                Ok(WaitStatus::Signaled(pid, sig, _)) => {
                    self.record(pid.as_raw(), ExitKind::Signaled(sig as i32))
                }
                Ok(WaitStatus::StillAlive) | Err(Errno::ECHILD) => break,
                Ok(_) => continue,
                Err(Errno::EINTR) => continue,
                Err(e) => {
                    debug!(error = %e, "waitpid failed");
                    break;
                }
            }
        }
    }

    fn record(&self, pid: i32, kind: ExitKind) {
        info!(pid, ?kind, "child exited");
        let mut exits = self.inner.exits.lock().unwrap_or_else(|p| p.into_inner());
        exits.insert(pid, kind);
        drop(exits);
        self.inner.changed.notify_waiters();
    }

    /// Drops an exit recorded for `pid` by an earlier process of the same pid, which nobody
    /// took: call right after starting a child. Safe against the child's own exit: exits are
    /// recorded under the same lock, and a child reaped before the lock is taken no longer
    /// exists, so its (real) exit is kept.
    pub fn forget_earlier_exit(&self, pid: i32) {
        let mut exits = self.inner.exits.lock().unwrap_or_else(|p| p.into_inner());
        if std::path::Path::new(&format!("/proc/{pid}")).exists() {
            exits.remove(&pid);
        }
    }

    /// Takes the recorded exit of `pid`, if it has been reaped.
    pub fn take_exit(&self, pid: i32) -> Option<ExitKind> {
        let mut exits = self.inner.exits.lock().unwrap_or_else(|p| p.into_inner());
        exits.remove(&pid)
    }

    /// How `pid` (a child of ours) exited, if it has, leaving the record in place.
    pub fn peek_exit(&self, pid: i32) -> Option<ExitKind> {
        self.reap_all();
        self.inner.exits.lock().unwrap_or_else(|p| p.into_inner()).get(&pid).copied()
    }

    /// Waits until `pid` (a child of ours) has exited and returns how.
    pub async fn wait_exit(&self, pid: i32) -> ExitKind {
        loop {
            let notified = self.inner.changed.notified();
            self.reap_all();
            if let Some(kind) = self.take_exit(pid) {
                return kind;
            }
            let _ = tokio::time::timeout(Duration::from_millis(100), notified).await;
        }
    }

    /// Runs `cmd` to its end; returns how it ended and what it wrote to stderr. The way to run
    /// a short program in stasisd: `Command::output` cannot wait for a child the reaper reaps.
    pub async fn run(&self, cmd: std::process::Command) -> std::io::Result<(ExitKind, String)> {
        let (exit, _, stderr) = self.run_output(cmd).await?;
        Ok((exit, stderr))
    }

    /// [`Reaper::run`], keeping what `cmd` wrote to stdout too: (how it ended, stdout, stderr).
    pub async fn run_output(
        &self,
        cmd: std::process::Command,
    ) -> std::io::Result<(ExitKind, String, String)> {
        let this = self.clone();
        let run =
            tokio::task::spawn_blocking(move || this.run_blocking(cmd, std::process::Stdio::null(), None));
        run.await.map_err(std::io::Error::other)?
    }

    /// Runs `cmd` to its end on this (blocking) thread, with `stdin` as its standard input:
    /// (how it ended, stdout, stderr). The way to run a short program from a blocking thread.
    ///
    /// With `deadline`, a program still running then is killed with its process group (give
    /// `cmd` one of its own, `process_group(0)`, for its children to go too), and the run
    /// fails with `TimedOut`.
    pub fn run_blocking(
        &self,
        mut cmd: std::process::Command,
        stdin: std::process::Stdio,
        deadline: Option<Duration>,
    ) -> std::io::Result<(ExitKind, String, String)> {
        use std::io::Read;
        use std::process::Stdio;
        let mut child = cmd.stdin(stdin).stdout(Stdio::piped()).stderr(Stdio::piped()).spawn()?;
        let pid = child.id() as i32;
        self.forget_earlier_exit(pid);
        // Readable once it exits; an error if it is already gone (and reaped): its exit is
        // then recorded, or on its way, and the loop below polls for it.
        let pidfd = super::sys::pidfd_open(pid);
        let mut watching = pidfd.is_ok();
        let read = |pipe: Option<Box<dyn Read + Send>>| {
            std::thread::spawn(move || {
                let mut text = String::new();
                if let Some(mut pipe) = pipe {
                    let _ = pipe.read_to_string(&mut text);
                }
                text
            })
        };
        let stdout = read(child.stdout.take().map(|p| Box::new(p) as Box<dyn Read + Send>));
        let stderr = read(child.stderr.take().map(|p| Box::new(p) as Box<dyn Read + Send>));
        let started = std::time::Instant::now();
        let mut killed = false;
        let exit = loop {
            self.reap_all();
            if let Some(kind) = self.take_exit(pid) {
                break kind;
            }
            if !killed && deadline.is_some_and(|d| started.elapsed() >= d) {
                kill_program(pid, &pidfd);
                killed = true;
            }
            let left = deadline.filter(|_| !killed).map(|d| d.saturating_sub(started.elapsed()));
            if wait_for_exit(pidfd.as_ref().ok().filter(|_| watching), left) {
                // Exited: reaped on the next look (or by another thread, which records it).
                watching = false;
            }
        };
        let (stdout, stderr) = (stdout.join().unwrap_or_default(), stderr.join().unwrap_or_default());
        if killed {
            let after = deadline.unwrap_or_default();
            return Err(std::io::Error::new(std::io::ErrorKind::TimedOut, format!("killed after {after:?}")));
        }
        Ok((exit, stdout, stderr))
    }

    /// Waits until none of `pids` is present (their pids free again: every zombie of ours
    /// reaped), or `timeout` passes. Returns the pids still present (running, or zombies of
    /// another parent).
    pub async fn wait_gone(&self, pids: &[i32], timeout: Duration) -> Vec<i32> {
        self.wait_until(pids, timeout, |_| false).await
    }

    /// Waits until none of `pids` runs: each is gone, or a zombie (dead, its memory freed,
    /// whichever parent has yet to reap it), or `timeout` passes. Returns those still running.
    pub async fn wait_dead(&self, pids: &[i32], timeout: Duration) -> Vec<i32> {
        self.wait_until(pids, timeout, ProcStat::is_dead).await
    }

    /// Waits until every one of `pids` is gone or `done`, reaping ours meanwhile.
    async fn wait_until(&self, pids: &[i32], timeout: Duration, done: fn(&ProcStat) -> bool) -> Vec<i32> {
        let deadline = tokio::time::Instant::now() + timeout;
        loop {
            let notified = self.inner.changed.notified();
            self.reap_all();
            let present: Vec<i32> =
                pids.iter().copied().filter(|p| ProcStat::read(*p).is_ok_and(|s| !done(&s))).collect();
            if present.is_empty() || tokio::time::Instant::now() >= deadline {
                return present;
            }
            let _ = tokio::time::timeout(Duration::from_millis(50), notified).await;
        }
    }
}

/// Kills `pid`, a program of [`Reaper::run_blocking`] past its deadline, and its process
/// group (a group of its own has its pid as id); `pidfd` is its `pidfd_open`. Returns whether
/// anything was signalled.
///
/// Any thread may reap it meanwhile, and its pid is then free for another process: so it is
/// signalled through its pidfd, and its group only while it is still there (running or a
/// zombie), when no other process can have its pid as a group id. Where no pidfd could be had
/// for it (a kernel before 5.3, no descriptor left) or it cannot be signalled through one, by
/// pid as before.
fn kill_program(pid: i32, pidfd: &std::io::Result<OwnedFd>) -> bool {
    use nix::sys::signal::{Signal, kill};
    let group = || kill(Pid::from_raw(-pid), Signal::SIGKILL).is_ok();
    let by_pid = || {
        let group = group();
        kill(Pid::from_raw(pid), Signal::SIGKILL).is_ok() || group
    };
    let reaped = |e: &std::io::Error| e.raw_os_error() == Some(libc::ESRCH);
    let fd = match pidfd {
        Ok(fd) => fd,
        // Gone before it could be watched: already reaped.
        Err(e) if reaped(e) => return false,
        Err(_) => return by_pid(),
    };
    match super::sys::pidfd_send_signal(fd.as_fd(), 0) {
        Ok(()) => {
            let group = group();
            super::sys::pidfd_send_signal(fd.as_fd(), Signal::SIGKILL as i32).is_ok() || group
        }
        // Reaped since it was watched.
        Err(e) if reaped(&e) => false,
        // A pidfd that cannot be signalled through (a seccomp filter, say).
        Err(_) => by_pid(),
    }
}

/// Waits until the process `exited` refers to has exited (then says so), `left` has passed,
/// or a second (the caller looks again); without a descriptor, a nap of 5 ms.
fn wait_for_exit(exited: Option<&OwnedFd>, left: Option<Duration>) -> bool {
    let Some(fd) = exited else {
        std::thread::sleep(Duration::from_millis(5));
        return false;
    };
    // In whole milliseconds, rounded up: less than one left must not poll for none and spin.
    let wait = left.unwrap_or(Duration::from_secs(1)).min(Duration::from_secs(1));
    let wait = Duration::from_millis(wait.as_micros().div_ceil(1000) as u64);
    let mut fds = [PollFd::new(fd.as_fd(), PollFlags::POLLIN)];
    poll(&mut fds, PollTimeout::try_from(wait).unwrap_or(PollTimeout::MAX)).is_ok_and(|ready| ready > 0)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn an_exit_recorded_for_a_live_pid_is_an_earlier_process_s_and_is_forgotten() {
        let reaper = Reaper::default();
        let alive = std::process::id() as i32;
        // Above any pid_max: no process has it, so an exit recorded for it is its own.
        let gone = 4_194_403;
        reaper.record(alive, ExitKind::Exited(3));
        reaper.record(gone, ExitKind::Signaled(9));
        reaper.forget_earlier_exit(alive);
        reaper.forget_earlier_exit(gone);
        assert_eq!(reaper.peek_exit(alive), None);
        assert_eq!(reaper.peek_exit(gone), Some(ExitKind::Signaled(9)));
    }

    #[test]
    fn a_program_past_its_deadline_is_killed_with_its_group_and_one_reaped_is_not_signalled() {
        use std::os::unix::process::{CommandExt, ExitStatusExt};
        let mut cmd = std::process::Command::new("sh");
        cmd.args(["-c", "sleep 30 & echo $!; wait"]).process_group(0).stdout(std::process::Stdio::piped());
        let mut child = cmd.spawn().unwrap();
        let pid = child.id() as i32;
        let mut line = String::new();
        std::io::BufRead::read_line(&mut std::io::BufReader::new(child.stdout.take().unwrap()), &mut line)
            .unwrap();
        let sleeper: i32 = line.trim().parse().unwrap();
        let pidfd = crate::sys::pidfd_open(pid);
        assert!(kill_program(pid, &pidfd), "a running program is signalled");
        assert_eq!(child.wait().unwrap().signal(), Some(9));
        // Its group went too: the sleep ends (its parent here is now the reaper of orphans).
        let started = std::time::Instant::now();
        while crate::proc::ProcStat::read(sleeper).is_ok_and(|s| !s.is_dead()) {
            assert!(started.elapsed() < Duration::from_secs(10), "the sleep of its group runs on");
            std::thread::sleep(Duration::from_millis(10));
        }
        // Reaped: its pid may be anyone's now, and nothing is sent to it or its group. Another
        // process given its pid stands for that here: a sleep leading a group of its own.
        assert!(!kill_program(pid, &pidfd));
        let mut stranger = std::process::Command::new("sleep");
        let mut stranger = stranger.arg("30").process_group(0).spawn().unwrap();
        assert!(!kill_program(stranger.id() as i32, &pidfd), "nothing is signalled");
        std::thread::sleep(Duration::from_millis(100));
        assert!(stranger.try_wait().unwrap().is_none(), "the other process runs on");
        stranger.kill().unwrap();
        stranger.wait().unwrap();
    }
}
