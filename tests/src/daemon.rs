//! A real stasisd in a temporary directory, and the real CLI talking to it.

use std::cell::RefCell;
use std::fs::File;
use std::io::Read;
use std::path::{Path, PathBuf};
use std::process::{Child, Command, ExitStatus, Output, Stdio};
use std::sync::atomic::{AtomicUsize, Ordering};
use std::time::{Duration, Instant};

use nix::sys::signal::Signal;
use serde_json::Value;
use tempfile::TempDir;

use crate::workload::Workload;
use crate::{TIMEOUT, bin, procfs};

/// How long one CLI command may take before the test fails (a checkpoint of a few dozen MiB
/// takes well under a second; this is for a slow, loaded machine).
const CLI_TIMEOUT: Duration = Duration::from_secs(120);

static DAEMONS: AtomicUsize = AtomicUsize::new(0);

/// How to start a test daemon: another store URL (default: a file store in the daemon's
/// directory), extra flags, extra environment.
#[derive(Debug, Clone, Default)]
pub struct DaemonOptions {
    pub store: Option<String>,
    pub args: Vec<String>,
    pub env: Vec<(String, String)>,
}

/// A running stasisd with its socket, state directory and file store in a fresh temporary
/// directory. Dropping it kills every workload it knows of and stops it.
pub struct Daemon {
    dir: TempDir,
    child: Child,
    socket: PathBuf,
    log: PathBuf,
    /// Makes workload names unique on this machine: workloads get a cgroup named after them,
    /// shared by every daemon, and tests run in parallel.
    tag: String,
    options: DaemonOptions,
    /// Workloads started through [`Daemon::run`], killed on drop even if `status` fails.
    started: RefCell<Vec<Workload>>,
}

/// Starts stasisd on `dir`'s socket, state directory and (by default) file store, appending
/// its output to `log`.
fn spawn_stasisd(dir: &Path, options: &DaemonOptions, log: &Path) -> Child {
    let store = options.store.clone().unwrap_or_else(|| format!("file://{}", dir.join("store").display()));
    let log_file = File::options().create(true).append(true).open(log).expect("daemon log file");
    Command::new(bin("stasisd"))
        .arg("--socket")
        .arg(dir.join("stasisd.sock"))
        .arg("--state-dir")
        .arg(dir.join("state"))
        .arg("--store")
        .arg(store)
        .args(&options.args)
        .envs(options.env.iter().map(|(k, v)| (k, v)))
        .env("NO_COLOR", "1")
        .stdin(Stdio::null())
        .stdout(log_file.try_clone().expect("daemon log file"))
        .stderr(log_file)
        .spawn()
        .expect("starting stasisd")
}

impl Daemon {
    /// Starts stasisd on a file store in its directory and waits until it serves.
    pub fn start() -> Daemon {
        Daemon::start_with(&DaemonOptions::default())
    }

    /// Starts stasisd with `options` and waits until it serves on its socket.
    pub fn start_with(options: &DaemonOptions) -> Daemon {
        let dir = tempfile::Builder::new().prefix("stasis-e2e-").tempdir().expect("temporary directory");
        let socket = dir.path().join("stasisd.sock");
        let log = dir.path().join("stasisd.log");
        let child = spawn_stasisd(dir.path(), options, &log);
        let n = DAEMONS.fetch_add(1, Ordering::Relaxed);
        let mut daemon = Daemon {
            tag: format!("{}-{n}", std::process::id()),
            dir,
            child,
            socket,
            log,
            options: options.clone(),
            started: RefCell::new(Vec::new()),
        };
        daemon.wait_serving();
        daemon
    }

    /// Kills stasisd with SIGKILL (a crash) and starts it again on the same state and store.
    pub fn kill9_and_restart(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
        self.child = spawn_stasisd(self.dir.path(), &self.options, &self.log);
        self.wait_serving();
    }

    /// Like [`Daemon::kill9_and_restart`], with `args` for the flags it was started with.
    pub fn kill9_and_restart_with(&mut self, args: &[&str]) {
        self.options.args = args.iter().map(|a| a.to_string()).collect();
        self.kill9_and_restart();
    }

    fn wait_serving(&mut self) {
        let deadline = Instant::now() + TIMEOUT;
        // A socket file left by a killed daemon is replaced by the new one.
        while self.cli(&["status"]).status.code() != Some(0) {
            if let Ok(Some(status)) = self.child.try_wait() {
                panic!("stasisd exited before serving ({status}):\n{}", self.log_tail(50));
            }
            assert!(
                Instant::now() < deadline,
                "stasisd did not serve within {TIMEOUT:?}:\n{}",
                self.log_tail(50)
            );
            std::thread::sleep(Duration::from_millis(20));
        }
    }

    /// The temporary directory holding everything of this daemon (a place for test files).
    pub fn dir(&self) -> &Path {
        self.dir.path()
    }

    /// stasisd's API socket.
    pub fn socket(&self) -> PathBuf {
        self.dir().join("stasisd.sock")
    }

    /// The file store's directory.
    pub fn store_dir(&self) -> PathBuf {
        self.dir.path().join("store")
    }

    /// The daemon's pid.
    pub fn pid(&self) -> i32 {
        self.child.id() as i32
    }

    /// `base` made unique on this machine, for a workload name.
    pub fn workload_name(&self, base: &str) -> String {
        format!("{base}-{}", self.tag)
    }

    /// The last `n` lines of the daemon's log.
    pub fn log_tail(&self, n: usize) -> String {
        let text = std::fs::read_to_string(&self.log).unwrap_or_default();
        let lines: Vec<&str> = text.lines().collect();
        lines[lines.len().saturating_sub(n)..].join("\n")
    }

    /// The `stasis --socket S <args>` command, to run as the caller likes (e.g. in the background).
    pub fn command(&self, args: &[&str]) -> Command {
        let mut cmd = Command::new(bin("stasis"));
        cmd.arg("--socket").arg(&self.socket).args(args);
        cmd
    }

    /// Runs `stasis --socket S <args>` and returns what it did.
    pub fn cli(&self, args: &[&str]) -> Output {
        run_with_timeout(self.command(args), CLI_TIMEOUT).unwrap_or_else(|e| {
            panic!("`stasis {}`: {e}\n--- stasisd log (tail) ---\n{}", args.join(" "), self.log_tail(40))
        })
    }

    /// Runs a CLI command that must succeed and print one JSON object; returns the object.
    pub fn json(&self, args: &[&str]) -> Value {
        let out = self.cli(args);
        let stdout = String::from_utf8_lossy(&out.stdout);
        assert!(
            out.status.success(),
            "`stasis {}` failed ({}):\n--- stderr ---\n{}\n--- stdout ---\n{stdout}\n--- stasisd log (tail) ---\n{}",
            args.join(" "),
            out.status,
            String::from_utf8_lossy(&out.stderr),
            self.log_tail(40)
        );
        serde_json::from_str(stdout.trim())
            .unwrap_or_else(|e| panic!("`stasis {}` printed no JSON object ({e}):\n{stdout}", args.join(" ")))
    }

    /// Runs a CLI command that must succeed (output not JSON).
    pub fn ok(&self, args: &[&str]) -> String {
        let out = self.cli(args);
        assert!(
            out.status.success(),
            "`stasis {}` failed ({}):\n--- stderr ---\n{}\n--- stasisd log (tail) ---\n{}",
            args.join(" "),
            out.status,
            String::from_utf8_lossy(&out.stderr),
            self.log_tail(40)
        );
        String::from_utf8_lossy(&out.stdout).into_owned()
    }

    /// Runs a CLI command that must fail with exit status 1 and `error: ...` on stderr;
    /// returns stderr.
    pub fn cli_err(&self, args: &[&str]) -> String {
        let out = self.cli(args);
        let stderr = String::from_utf8_lossy(&out.stderr).into_owned();
        assert_eq!(
            out.status.code(),
            Some(1),
            "`stasis {}` should have failed with exit status 1, got {}:\n--- stdout ---\n{}\n--- stderr ---\n{stderr}",
            args.join(" "),
            out.status,
            String::from_utf8_lossy(&out.stdout),
        );
        assert!(
            stderr.starts_with("error: "),
            "`stasis {}`: stderr should start with `error: `:\n{stderr}",
            args.join(" ")
        );
        stderr
    }

    /// Runs `checkpoint --workload NAME --leave-running --json` and calls `probe` over and
    /// over while it runs (each call should ask the workload something and assert the
    /// answer). Returns the checkpoint's result and how many probes were made.
    pub fn checkpoint_while(&self, workload: &str, mut probe: impl FnMut()) -> (Value, usize) {
        let mut ck = self
            .command(&["checkpoint", "--workload", workload, "--leave-running", "--json"])
            .stdout(Stdio::piped())
            .stderr(Stdio::piped())
            .spawn()
            .expect("starting stasis checkpoint");
        let (started, mut probes) = (Instant::now(), 0);
        while ck.try_wait().expect("waiting for stasis checkpoint").is_none() {
            assert!(started.elapsed() < CLI_TIMEOUT, "checkpoint --leave-running hangs");
            probe();
            probes += 1;
        }
        let out = ck.wait_with_output().expect("stasis checkpoint output");
        let stderr = String::from_utf8_lossy(&out.stderr);
        assert!(out.status.success(), "checkpoint --leave-running: {stderr}\n{}", self.log_tail(40));
        let result = serde_json::from_slice(&out.stdout).expect("checkpoint --leave-running JSON");
        eprintln!(
            "checkpoint --leave-running took {:?}, {probes} probes answered meanwhile",
            started.elapsed()
        );
        (result, probes)
    }

    /// Starts `argv` as workload `<base>-<tag>` (see [`Daemon::workload_name`]).
    pub fn run(&self, base: &str, argv: &[String]) -> Workload {
        let name = self.workload_name(base);
        let mut args = vec!["run", "--workload", &name, "--json", "--"];
        args.extend(argv.iter().map(String::as_str));
        let out = self.json(&args);
        assert_eq!(out["workload"], name.as_str(), "run result: {out}");
        let workload = Workload {
            name,
            pid: pid_of(&out),
            log: PathBuf::from(out["log"].as_str().expect("run result has a log path")),
            argv: argv.to_vec(),
        };
        self.started.borrow_mut().push(workload.clone());
        workload
    }

    /// Evicts workload `w` (a checkpoint without --leave-running), waits until its tree is
    /// gone, and restores that checkpoint with the extra `stasis restore` flags `restore`;
    /// the restore's answer.
    pub fn evict_and_restore(&self, w: &mut Workload, restore: &[&str]) -> Value {
        let ck = self.json(&["checkpoint", "--workload", &w.name, "--json"]);
        assert_eq!(ck["left_running"], false, "{ck}");
        let pid = w.pid;
        procfs::wait_gone(pid, "the evicted tree to be gone");
        let mut args = vec!["restore", "--workload", &w.name, "--json"];
        args.extend_from_slice(restore);
        let r = self.json(&args);
        assert_eq!(r["id"], ck["id"], "{r}");
        w.restored(&r);
        r
    }

    /// Workload `name` in `status --json`.
    pub fn workload(&self, name: &str) -> Value {
        let all = self.workloads();
        all.into_iter().find(|w| w["name"] == name).unwrap_or_else(|| panic!("{name} is not in status"))
    }

    /// Workload `name` (running `argv`) as `status --json` shows it: its pid and its log.
    pub fn known(&self, name: &str, argv: &[String]) -> Workload {
        let status = self.workload(name);
        let log =
            PathBuf::from(status["log_path"].as_str().unwrap_or_else(|| panic!("no log path: {status}")));
        Workload { name: name.to_owned(), pid: pid_of(&status), log, argv: argv.to_vec() }
    }

    /// The `workloads` of `status --json`.
    pub fn workloads(&self) -> Vec<Value> {
        match self.json(&["status", "--json"])["workloads"].as_array() {
            Some(list) => list.clone(),
            None => panic!("status --json has no workloads array"),
        }
    }

    /// Kills (SIGKILL) every process tree this daemon knows of: the workloads of
    /// `status --json` and those started by [`Daemon::run`]. A pid is only killed while it is
    /// in the workload's cgroup or runs the workload's command, so a reused pid is left alone.
    /// (The command alone is not enough: a lazily restored process shows an empty command line
    /// until the page holding it has arrived.)
    fn kill_workloads(&self) {
        let mut roots: Vec<(i32, String, Vec<String>)> =
            self.started.borrow().iter().map(|w| (w.pid, w.name.clone(), w.argv.clone())).collect();
        if let Ok(out) = run_with_timeout(self.command(&["status", "--json"]), TIMEOUT) {
            let status: Value = serde_json::from_slice(&out.stdout).unwrap_or(Value::Null);
            for w in status["workloads"].as_array().into_iter().flatten() {
                let command = w["command"].as_array().into_iter().flatten();
                let argv = command.filter_map(|a| a.as_str().map(str::to_owned));
                if let (Some(pid), Some(name)) = (w["pid"].as_i64(), w["name"].as_str()) {
                    roots.push((pid as i32, name.to_owned(), argv.collect()));
                }
            }
        }
        let mut doomed = Vec::new();
        for (pid, name, argv) in roots {
            let in_cgroup = procfs::cgroup(pid)
                .is_some_and(|c| c.contains("/stasis/") && c.ends_with(&format!("/{name}")));
            if pid > 1 && (in_cgroup || procfs::cmdline(pid).as_ref() == Some(&argv)) {
                doomed.push(pid);
                doomed.extend(procfs::descendants(pid));
            }
        }
        for pid in &doomed {
            procfs::kill9(*pid);
        }
    }

    /// Sends SIGTERM and waits up to 15 s for stasisd to exit; `None` if it had to be killed.
    pub fn stop(&mut self) -> Option<ExitStatus> {
        let _ = nix::sys::signal::kill(nix::unistd::Pid::from_raw(self.pid()), Signal::SIGTERM);
        let deadline = Instant::now() + Duration::from_secs(15);
        while Instant::now() < deadline {
            if let Ok(Some(status)) = self.child.try_wait() {
                return Some(status);
            }
            std::thread::sleep(Duration::from_millis(20));
        }
        eprintln!("stasisd did not stop within 15 s of SIGTERM; killing it");
        let _ = self.child.kill();
        let _ = self.child.wait();
        None
    }
}

impl Drop for Daemon {
    fn drop(&mut self) {
        if std::thread::panicking() {
            eprintln!(
                "--- stasisd log ({}) ---\n{}\n--- end of stasisd log ---",
                self.log.display(),
                self.log_tail(200)
            );
        }
        self.kill_workloads();
        self.stop();
    }
}

/// The `pid` field of a CLI result.
pub fn pid_of(value: &Value) -> i32 {
    value["pid"].as_i64().unwrap_or_else(|| panic!("no pid in {value}")) as i32
}

/// Runs `cmd` with captured stdout and stderr; kills it after `timeout`.
fn run_with_timeout(mut cmd: Command, timeout: Duration) -> Result<Output, String> {
    let mut child = cmd
        .stdin(Stdio::null())
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .spawn()
        .map_err(|e| format!("cannot start: {e}"))?;
    let drain = |pipe: Option<Box<dyn Read + Send>>| {
        std::thread::spawn(move || {
            let mut buf = Vec::new();
            if let Some(mut pipe) = pipe {
                let _ = pipe.read_to_end(&mut buf);
            }
            buf
        })
    };
    let stdout = drain(child.stdout.take().map(|p| Box::new(p) as Box<dyn Read + Send>));
    let stderr = drain(child.stderr.take().map(|p| Box::new(p) as Box<dyn Read + Send>));
    let deadline = Instant::now() + timeout;
    let status = loop {
        match child.try_wait() {
            Ok(Some(status)) => break status,
            Ok(None) if Instant::now() < deadline => std::thread::sleep(Duration::from_millis(10)),
            Ok(None) => {
                let _ = child.kill();
                let _ = child.wait();
                return Err(format!("still running after {timeout:?}; killed"));
            }
            Err(e) => return Err(format!("waiting for it: {e}")),
        }
    };
    Ok(Output {
        status,
        stdout: stdout.join().unwrap_or_default(),
        stderr: stderr.join().unwrap_or_default(),
    })
}
