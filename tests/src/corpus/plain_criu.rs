//! Plain CRIU on the same case, for comparison: `criu dump` and `criu restore` from the
//! command line, with the CRIU stasisd uses and the options the case needs, images on disk.

use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};

use super::driver::Driver;
use super::{Tree, outside};
use crate::{TIMEOUT, criu_path, expect_within, wait_for};

/// What every dump and restore gets: the programs may be started in this test's session (a
/// shell job) and may hold connections, locks and Unix sockets whose peers are outside the tree.
const OPTIONS: [&str; 6] =
    ["--shell-job", "--tcp-established", "--file-locks", "--network-lock", "nftables", "-v4"];

/// Plain CRIU, with the program started by this test and dumped by pid.
#[derive(Default)]
pub(super) struct PlainCriu {
    images: PathBuf,
}

impl PlainCriu {
    /// Runs `criu <args>` with its log in `log` (under the images); on failure, its errors.
    fn criu(&self, args: &[&str], log: &str) -> Result<(), String> {
        let log = self.images.join(log);
        let out = Command::new(criu_path())
            .args(args)
            .args(["-D", &self.images.to_string_lossy(), "-o", &log.to_string_lossy()])
            .args(OPTIONS)
            .stdin(Stdio::null())
            .output()
            .unwrap_or_else(|e| panic!("running {}: {e}", criu_path().display()));
        if out.status.success() {
            return Ok(());
        }
        Err(format!("criu {} failed ({}): {}", args[0], out.status, errors(&log)))
    }

    /// Starts CRIU's lazy-pages daemon on the images and waits until it listens.
    fn lazy_pages(&self) -> Child {
        let log = self.images.join("lazy-pages.log");
        let daemon = Command::new(criu_path())
            .args(["lazy-pages", "-D", &self.images.to_string_lossy(), "-o", &log.to_string_lossy(), "-v4"])
            .stdin(Stdio::null())
            .spawn()
            .expect("starting criu lazy-pages");
        let socket = self.images.join("lazy-pages.socket");
        expect_within(TIMEOUT, "criu lazy-pages to listen", || socket.exists().then_some(()));
        daemon
    }
}

/// The error lines of a CRIU log (else its last lines), on one line each.
fn errors(log: &Path) -> String {
    let text = std::fs::read_to_string(log).unwrap_or_default();
    let lines: Vec<&str> = text.lines().collect();
    let errors: Vec<&str> = lines.iter().copied().filter(|l| l.contains("Error")).collect();
    let shown = if errors.is_empty() { &lines[lines.len().saturating_sub(5)..] } else { &errors[..] };
    shown.iter().take(8).map(|l| l.trim()).collect::<Vec<_>>().join(" | ")
}

impl Driver for PlainCriu {
    fn start_name(&self) -> &'static str {
        "plain CRIU"
    }

    fn start(&mut self, argv: &[String], dir: &Path) -> Tree {
        self.images = dir.join("images");
        std::fs::create_dir_all(&self.images).expect("the images directory");
        outside::spawn(argv, dir)
    }

    fn checkpoint(&mut self, tree: &Tree, leave_running: bool) -> Result<String, String> {
        let pid = tree.root.to_string();
        let mut args = vec!["dump", "-t", &pid, "--ext-unix-sk"];
        if leave_running {
            args.push("--leave-running");
        }
        // A failed dump is a failure, not a refusal: CRIU froze the tree to find out.
        self.criu(&args, "dump.log").unwrap_or_else(|e| panic!("{e}"));
        Ok(String::new())
    }

    fn restore(&mut self, tree: &mut Tree, _id: &str, lazy: bool) {
        let pidfile = self.images.join("restored.pid");
        let pidfile_arg = pidfile.to_string_lossy().into_owned();
        let mut args = vec!["restore", "--restore-detached", "--pidfile", &pidfile_arg];
        let mut lazy_pages = lazy.then(|| self.lazy_pages());
        if lazy {
            args.push("--lazy-pages");
        }
        let restored = self.criu(&args, "restore.log");
        if let Some(daemon) = &mut lazy_pages {
            if restored.is_err() {
                let _ = daemon.kill();
            }
            // It exits once every page is in.
            let status = wait_for(TIMEOUT * 3, || daemon.try_wait().expect("waiting for criu lazy-pages"));
            let log = errors(&self.images.join("lazy-pages.log"));
            let Some(status) = status else {
                let _ = daemon.kill();
                let _ = daemon.wait();
                panic!("criu lazy-pages did not finish within {:?}: {log}", TIMEOUT * 3);
            };
            assert!(status.success(), "criu lazy-pages: {status}: {log}");
        }
        restored.unwrap_or_else(|e| panic!("{e}"));
        let pid = std::fs::read_to_string(&pidfile).expect("criu's pid file");
        let pid: i32 = pid.trim().parse().expect("a pid in criu's pid file");
        assert_eq!(pid, tree.root, "CRIU restores the tree with its pids");
    }
}
