//! Podman for the interop tests, set apart from the machine's: its own storage and run
//! directories and configuration in a temporary directory, runc as its runtime (crun refuses
//! this machine's hybrid cgroup layout), the project's CRIU on `PATH` (Podman's runtime runs
//! `criu`), and a small image made here from Debian's busybox-static (nothing is pulled).

use std::path::{Path, PathBuf};
use std::process::{Command, Output, Stdio};

use tempfile::TempDir;

use crate::criu_path;

/// The image the tests' containers run.
pub const IMAGE: &str = "localhost/stasis-test-busybox:1";

pub struct Podman {
    dir: TempDir,
    /// Environment every `podman` of these tests runs with, stasisd's included.
    pub env: Vec<(String, String)>,
}

impl Podman {
    /// Sets Podman up with the test image; `None` (and a note) where Podman is missing.
    pub fn start() -> Option<Podman> {
        let podman = Command::new("podman").arg("--version").output();
        if !podman.is_ok_and(|o| o.status.success()) || !Path::new("/bin/busybox").exists() {
            eprintln!("skipping: podman or /bin/busybox missing (scripts/test.sh installs them)");
            return None;
        }
        let dir = tempfile::Builder::new().prefix("stasis-podman-").tempdir().expect("podman directory");
        let conf = dir.path().join("containers.conf");
        // Its runtime files and network settings its own too: another test's Podman, resetting
        // itself, would otherwise remove them (the default /run/libpod) from under this one.
        let engine = format!(
            "[engine]\nruntime = \"runc\"\ntmp_dir = \"{}\"\n[network]\nnetwork_config_dir = \"{}\"\n",
            dir.path().join("tmp").display(),
            dir.path().join("networks").display()
        );
        std::fs::write(&conf, engine).expect("containers.conf");
        let storage = dir.path().join("storage.conf");
        let store = format!(
            "[storage]\ndriver = \"overlay\"\ngraphroot = \"{}\"\nrunroot = \"{}\"\n",
            dir.path().join("graph").display(),
            dir.path().join("run").display()
        );
        std::fs::write(&storage, store).expect("storage.conf");
        let criu_dir = criu_path().parent().expect("CRIU's directory").to_path_buf();
        let path = format!("{}:{}", criu_dir.display(), std::env::var("PATH").unwrap_or_default());
        let env = [("CONTAINERS_CONF", conf), ("CONTAINERS_STORAGE_CONF", storage)]
            .map(|(k, v)| (k.to_string(), v.display().to_string()))
            .into_iter()
            .chain([("PATH".to_string(), path)])
            .collect();
        let podman = Podman { dir, env };
        podman.build_image();
        Some(podman)
    }

    /// `podman ARGS`, which must succeed; its output.
    pub fn ok(&self, args: &[&str]) -> String {
        let out = self.run(args);
        assert!(out.status.success(), "podman {}: {}", args.join(" "), String::from_utf8_lossy(&out.stderr));
        String::from_utf8_lossy(&out.stdout).trim().to_owned()
    }

    pub fn run(&self, args: &[&str]) -> Output {
        self.command().args(args).stdin(Stdio::null()).output().expect("podman")
    }

    fn command(&self) -> Command {
        let mut cmd = Command::new("podman");
        cmd.envs(self.env.iter().map(|(k, v)| (k, v)));
        cmd
    }

    /// Starts container `name` of the test image running `script` in its shell, without a
    /// network, with limits root may set here (it lacks CAP_SYS_RESOURCE).
    pub fn run_container(&self, name: &str, script: &str) {
        let limits = ["--ulimit", "nofile=1024:1024", "--ulimit", "nproc=4096:4096"];
        let mut args = vec!["run", "-d", "--name", name, "--network", "none"];
        args.extend(limits);
        args.extend([IMAGE, "/bin/sh", "-c", script]);
        self.ok(&args);
    }

    /// What container `name` printed.
    pub fn logs(&self, name: &str) -> Vec<String> {
        let out = self.run(&["logs", name]);
        String::from_utf8_lossy(&out.stdout).lines().map(str::to_owned).collect()
    }

    /// A path in this Podman's directory (for archives).
    pub fn path(&self, name: &str) -> PathBuf {
        self.dir.path().join(name)
    }

    /// The busybox root file system the test image was made of, as a tar.
    pub fn rootfs(&self) -> String {
        self.dir.path().join("rootfs.tar").display().to_string()
    }

    /// Imports a root file system of busybox and its applets as the test image.
    fn build_image(&self) {
        let root = self.dir.path().join("rootfs");
        std::fs::create_dir_all(root.join("bin")).expect("rootfs");
        std::fs::copy("/bin/busybox", root.join("bin/busybox")).expect("busybox");
        for applet in ["sh", "sleep", "echo", "cat"] {
            std::os::unix::fs::symlink("busybox", root.join("bin").join(applet)).expect("applet link");
        }
        let tar = self.dir.path().join("rootfs.tar");
        let status = Command::new("tar").arg("-C").arg(&root).arg("-cf").arg(&tar).arg(".").status();
        assert!(status.is_ok_and(|s| s.success()), "packing the rootfs");
        self.ok(&["import", &tar.display().to_string(), IMAGE]);
    }
}

impl Drop for Podman {
    fn drop(&mut self) {
        // Containers, then their storage's mounts, before the directory goes.
        let _ = self.run(&["rm", "-a", "-f"]);
        let _ = self.run(&["system", "reset", "--force"]);
    }
}
