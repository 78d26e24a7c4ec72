//! Driving stasisd and the `stasis` CLI, and undoing what a run started: when it ends, fails
//! half-way, or is interrupted (SIGINT, SIGTERM, SIGHUP).

use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::sync::Mutex;
use std::sync::atomic::{AtomicBool, Ordering};
use std::time::{Duration, Instant};

use anyhow::{Context, bail};
use nix::fcntl::{PosixFadviseAdvice, posix_fadvise};
use nix::sys::signal::{Signal, kill};
use nix::sys::wait::{WaitPidFlag, WaitStatus, waitpid};
use nix::unistd::Pid;
use serde_json::Value;
use signal_hook::consts::{SIGHUP, SIGINT, SIGTERM};
use signal_hook::iterator::Signals;

/// What a run must undo; shared with the thread that handles signals.
struct Undo {
    daemon: Pid,
    workload: Option<i32>,
    work: PathBuf,
    scratch: PathBuf,
    keep: bool,
}

static UNDO: Mutex<Option<Undo>> = Mutex::new(None);

/// Kills the workload, stops stasisd and removes the run's directories (`work` only without
/// `--keep`); the first call does it, holding the lock so that a concurrent call waits.
fn undo() {
    let mut guard = UNDO.lock().unwrap_or_else(|poisoned| poisoned.into_inner());
    let Some(u) = guard.take() else { return };
    if let Some(pid) = u.workload {
        let _ = kill_and_wait(pid);
    }
    let _ = kill(u.daemon, Signal::SIGTERM);
    let exited = || !matches!(waitpid(u.daemon, Some(WaitPidFlag::WNOHANG)), Ok(WaitStatus::StillAlive));
    if wait_until("stasisd to stop", Duration::from_secs(20), exited).is_err() {
        let _ = kill(u.daemon, Signal::SIGKILL);
        let _ = waitpid(u.daemon, None);
    }
    if u.keep {
        eprintln!("kept {}", u.work.display());
    } else {
        let _ = std::fs::remove_dir_all(&u.work);
    }
    let _ = std::fs::remove_dir_all(&u.scratch);
}

/// Undoes the run, then exits, on SIGINT, SIGTERM or SIGHUP.
pub fn undo_on_signals() -> anyhow::Result<()> {
    let mut signals = Signals::new([SIGINT, SIGTERM, SIGHUP]).context("installing signal handlers")?;
    std::thread::spawn(move || {
        if let Some(signal) = signals.forever().next() {
            eprintln!("stasis-bench: signal {signal}, cleaning up");
            undo();
            std::process::exit(128 + signal);
        }
    });
    Ok(())
}

/// Settings of a stasisd beyond the defaults.
#[derive(Debug, Clone, Default)]
pub struct Extra {
    /// Store URL (default: a file store in the run's directory).
    pub store: Option<String>,
    pub env: Vec<(String, String)>,
    pub args: Vec<String>,
}

/// A running stasisd. Dropping it undoes the run.
pub struct Daemon {
    child: Child,
    socket: PathBuf,
    /// The local store's directory (none for a store elsewhere).
    store_dir: Option<PathBuf>,
    /// On disk: stasisd's state, its store, the peer's tarballs.
    pub work: PathBuf,
    /// In tmpfs: the peer's image directories.
    pub scratch: PathBuf,
}

impl Daemon {
    /// Starts stasisd with its state under `work`, a `file://` store there (or
    /// `extra.store`) and `extra`'s settings, and waits for it.
    pub fn start(
        criu: &Path,
        work: PathBuf,
        scratch: PathBuf,
        keep: bool,
        extra: &Extra,
    ) -> anyhow::Result<Self> {
        std::fs::create_dir_all(&work).with_context(|| format!("creating {}", work.display()))?;
        std::fs::create_dir_all(&scratch).with_context(|| format!("creating {}", scratch.display()))?;
        let socket = work.join("stasisd.sock");
        let mut cmd = Command::new("target/release/stasisd");
        cmd.arg("--socket").arg(&socket).arg("--state-dir").arg(work.join("state"));
        let (store, store_dir) = match &extra.store {
            Some(url) => (url.clone(), None),
            None => {
                let dir = work.join("store");
                (format!("file://{}", dir.display()), Some(dir))
            }
        };
        cmd.arg("--store").arg(store).envs(extra.env.iter().map(|(k, v)| (k, v)));
        cmd.arg("--criu").arg(criu).args(["--keep-last", "0"]).args(&extra.args);
        let log = std::fs::File::create(work.join("stasisd.log"))?;
        let child = cmd
            .stdin(Stdio::null())
            .stdout(log.try_clone()?)
            .stderr(log)
            .spawn()
            .context("starting target/release/stasisd (build with cargo build --release --workspace)")?;
        let daemon = Pid::from_raw(child.id() as i32);
        let undo = Undo { daemon, workload: None, work: work.clone(), scratch: scratch.clone(), keep };
        *UNDO.lock().unwrap_or_else(|poisoned| poisoned.into_inner()) = Some(undo);
        let daemon = Self { child, socket, store_dir, work, scratch };
        wait_until("stasisd's socket", Duration::from_secs(30), || daemon.cli(&["status", "--json"]).is_ok())
            .with_context(|| format!("stasisd's log:\n{}", daemon.log_tail()))?;
        Ok(daemon)
    }

    /// Records the workload's root process, to kill if the run ends early.
    pub fn set_workload(&self, pid: Option<i32>) {
        if let Some(u) = UNDO.lock().unwrap_or_else(|poisoned| poisoned.into_inner()).as_mut() {
            u.workload = pid;
        }
    }

    /// The last lines of stasisd's log (for errors: the log goes with the run's directory).
    pub fn log_tail(&self) -> String {
        let text = std::fs::read_to_string(self.work.join("stasisd.log")).unwrap_or_default();
        let lines: Vec<&str> = text.lines().collect();
        lines[lines.len().saturating_sub(30)..].join("\n")
    }

    fn pid(&self) -> u32 {
        self.child.id()
    }

    /// Runs `stasis --socket … <args>` and parses its JSON output.
    pub fn cli(&self, args: &[&str]) -> anyhow::Result<Value> {
        let out = Command::new("target/release/stasis")
            .arg("--socket")
            .arg(&self.socket)
            .args(args)
            .output()
            .context("running target/release/stasis")?;
        if !out.status.success() {
            bail!(
                "`stasis {}` failed ({}): {}{}",
                args.join(" "),
                out.status,
                String::from_utf8_lossy(&out.stdout),
                String::from_utf8_lossy(&out.stderr)
            );
        }
        serde_json::from_slice(&out.stdout)
            .with_context(|| format!("`stasis {}` printed no JSON", args.join(" ")))
    }

    /// Resets stasisd's peak resident memory to its current one (`clear_refs` 5).
    pub fn reset_peak_rss(&self) -> anyhow::Result<()> {
        std::fs::write(format!("/proc/{}/clear_refs", self.pid()), "5").context("resetting stasisd's VmHWM")
    }

    /// Bytes stasisd has read from storage since it started (`read_bytes` of its /proc io).
    pub fn disk_read_bytes(&self) -> anyhow::Result<u64> {
        let io = std::fs::read_to_string(format!("/proc/{}/io", self.pid()))?;
        io.lines()
            .find_map(|l| l.strip_prefix("read_bytes:")?.trim().parse().ok())
            .context("no read_bytes in stasisd's /proc io")
    }

    /// Drops a local store's files from the page cache, so that the next restore reads the
    /// store from its disk at every size, as a restore on another node would (at the largest
    /// sizes the packs do not stay cached beside the workload anyway). Nothing for a store
    /// elsewhere.
    pub fn uncache_store(&self) -> anyhow::Result<()> {
        let Some(dir) = &self.store_dir else { return Ok(()) };
        // Files come and go meanwhile (leases under locks/): one gone is nothing to drop.
        let gone = |e: &std::io::Error| e.kind() == std::io::ErrorKind::NotFound;
        let mut dirs = vec![dir.clone()];
        while let Some(dir) = dirs.pop() {
            let entries = match std::fs::read_dir(&dir) {
                Err(e) if gone(&e) => continue,
                listed => listed.with_context(|| format!("listing {}", dir.display()))?,
            };
            for entry in entries {
                let (path, kind) = match entry.and_then(|e| Ok((e.path(), e.file_type()?))) {
                    Err(e) if gone(&e) => continue,
                    found => found?,
                };
                if !kind.is_file() {
                    if kind.is_dir() {
                        dirs.push(path);
                    }
                    continue;
                }
                let file = match std::fs::File::open(&path) {
                    Err(e) if gone(&e) => continue,
                    opened => opened.with_context(|| format!("opening {}", path.display()))?,
                };
                posix_fadvise(&file, 0, 0, PosixFadviseAdvice::POSIX_FADV_DONTNEED)
                    .with_context(|| format!("dropping {} from the page cache", path.display()))?;
            }
        }
        Ok(())
    }

    /// stasisd's peak resident memory (VmHWM) since it started or the last reset, bytes.
    pub fn peak_rss(&self) -> anyhow::Result<u64> {
        stasis_tests::procfs::status_bytes(self.pid() as i32, "VmHWM")
            .context("no VmHWM in stasisd's /proc status")
    }
}

impl Drop for Daemon {
    fn drop(&mut self) {
        undo();
        // Already reaped by `undo`; this only settles `Child`'s own bookkeeping.
        let _ = self.child.try_wait();
    }
}

/// Polls `done` every 10 ms until it holds or `timeout` passes.
pub fn wait_until(what: &str, timeout: Duration, mut done: impl FnMut() -> bool) -> anyhow::Result<()> {
    let deadline = Instant::now() + timeout;
    while !done() {
        if Instant::now() > deadline {
            bail!("timed out after {timeout:?} waiting for {what}");
        }
        std::thread::sleep(Duration::from_millis(10));
    }
    Ok(())
}

/// SIGKILLs `pid` and waits until it is gone from /proc (reaped, not a zombie: CRIU cannot
/// restore a tree onto a pid that is still taken).
pub fn kill_and_wait(pid: i32) -> anyhow::Result<()> {
    let _ = kill(Pid::from_raw(pid), Signal::SIGKILL);
    wait_until(&format!("pid {pid} to be reaped"), Duration::from_secs(30), || {
        !Path::new(&format!("/proc/{pid}")).exists()
    })
}

/// Whether `settle` waits (`--no-settle` measures back to back).
pub static SETTLE: AtomicBool = AtomicBool::new(true);

/// Lets the machine quiesce before a measurement, so one pipeline's leftovers do not slow the
/// next: flushes dirty pages (the previous checkpoint's store writes), waits for writeback,
/// then for the kernel to hand freed memory back to the hypervisor (free page reporting runs
/// about 2 s after pages are freed), so every measurement starts from the same state.
pub fn settle() {
    if !SETTLE.load(Ordering::Relaxed) {
        return;
    }
    let _ = Command::new("sync").status();
    let pending = || {
        let info = std::fs::read_to_string("/proc/meminfo").unwrap_or_default();
        let kib = |key: &str| -> u64 {
            info.lines()
                .find_map(|l| l.strip_prefix(key)?.split_whitespace().next()?.parse().ok())
                .unwrap_or(0)
        };
        kib("Dirty:") + kib("Writeback:")
    };
    let _ = wait_until("writeback", Duration::from_secs(60), || pending() < 16 << 10);
    std::thread::sleep(Duration::from_secs(3));
}

/// The first line of `log` starting with `prefix`.
pub fn log_line(log: &Path, prefix: &str) -> Option<String> {
    std::fs::read_to_string(log).ok()?.lines().find(|l| l.starts_with(prefix)).map(str::to_string)
}
