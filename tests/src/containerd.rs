//! containerd for the Kubernetes tests, as a kubelet's node has it: containerd 1.7 (Debian 13's,
//! from scripts/setup-containerd.sh) started as the test's child on a configuration of its own
//! (its own root, state and sockets in a temporary directory; the CRI plugin with Debian 12's
//! runc; NRI enabled on its own socket; `restrict_oom_score_adj`, since root lacks
//! CAP_SYS_RESOURCE here), with a pause image and the busybox test image imported (built with
//! Podman; nothing is pulled). [`Cri`] speaks the CRI to it as a kubelet would.

use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::time::Duration;

use stasis_proto::cri::runtime_service_client::RuntimeServiceClient;
use stasis_proto::tonic::transport::Channel;
use tempfile::TempDir;

use crate::podman::{IMAGE, Podman};
use crate::{TIMEOUT, expect_within};

/// The sandbox ("pause") image: sleeps.
pub const PAUSE_IMAGE: &str = "localhost/stasis-test-pause:1";

/// Another image of the test image's files.
pub const NEXT_IMAGE: &str = "localhost/stasis-test-busybox:2";

pub struct Containerd {
    dir: TempDir,
    child: Child,
    bin: PathBuf,
}

impl Containerd {
    /// Starts containerd with both images; `None` (and a note) where it or Podman is missing.
    pub fn start(podman: &Podman) -> Option<Containerd> {
        let bin = std::env::var_os("STASIS_CONTAINERD")
            .map(PathBuf::from)
            .unwrap_or_else(|| Path::new(env!("CARGO_MANIFEST_DIR")).join("../.stasis/containerd/usr/bin"));
        if !bin.join("containerd").exists() {
            eprintln!("skipping: no containerd at {} (scripts/setup-containerd.sh)", bin.display());
            return None;
        }
        let dir =
            tempfile::Builder::new().prefix("stasis-containerd-").tempdir().expect("containerd directory");
        std::fs::write(dir.path().join("config.toml"), config_for(dir.path())).expect("containerd config");
        let child = spawn(&bin, dir.path());
        let containerd = Containerd { dir, child, bin };
        expect_within(TIMEOUT, "containerd's socket", || containerd.socket().exists().then_some(()));
        podman.ok(&[
            "import",
            "--change",
            r#"ENTRYPOINT ["/bin/sleep", "2147483647"]"#,
            &podman.rootfs(),
            PAUSE_IMAGE,
        ]);
        // The test image again, another image to the runtime (its configuration differs): what
        // a rollout brings.
        podman.ok(&["import", "--change", "LABEL stasis.test=next", &podman.rootfs(), NEXT_IMAGE]);
        for image in [PAUSE_IMAGE, IMAGE, NEXT_IMAGE] {
            containerd.take_image(podman, image);
        }
        Some(containerd)
    }

    /// Copies image `name` from Podman's store into this containerd's.
    fn take_image(&self, podman: &Podman, name: &str) {
        let archive = podman.path("image.tar");
        let _ = std::fs::remove_file(&archive);
        podman.ok(&["save", "--format", "oci-archive", "-o", &archive.display().to_string(), name]);
        self.ctr(&["images", "import", &archive.display().to_string()]);
    }

    /// Makes image `name`: the test image's files and `files` (host file, absolute path in the
    /// image), for a workload the test image lacks.
    pub fn add_image(&self, podman: &Podman, name: &str, files: &[(&Path, &str)]) {
        let extra = self.dir.path().join("extra-rootfs");
        let _ = std::fs::remove_dir_all(&extra);
        for (host, inside) in files {
            let at = extra.join(inside.trim_start_matches('/'));
            std::fs::create_dir_all(at.parent().expect("a directory")).expect("image directory");
            std::fs::copy(host, &at).unwrap_or_else(|e| panic!("{} into the image: {e}", host.display()));
        }
        let tar = self.dir.path().join("extra-rootfs.tar");
        let _ = std::fs::remove_file(&tar);
        std::fs::copy(podman.rootfs(), &tar).expect("the test image's files");
        // Their top directories by name: a second `.` entry would be a duplicate path.
        let tops = std::fs::read_dir(&extra).expect("image files").flatten().map(|e| e.file_name());
        let added = Command::new("tar").arg("-rf").arg(&tar).arg("-C").arg(&extra).args(tops).status();
        assert!(added.is_ok_and(|s| s.success()), "adding files to the image");
        podman.ok(&["import", &tar.display().to_string(), name]);
        self.take_image(podman, name);
    }

    /// Kills containerd (SIGKILL; its containers run on under their shims) and starts it again
    /// on the same state, as a node's containerd restarts.
    pub fn restart(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
        let _ = std::fs::remove_file(self.socket());
        self.child = spawn(&self.bin, self.dir.path());
        expect_within(TIMEOUT, "containerd's socket again", || self.socket().exists().then_some(()));
    }

    pub fn socket(&self) -> PathBuf {
        self.dir.path().join("containerd.sock")
    }

    /// NRI's socket, where plugins register.
    pub fn nri_socket(&self) -> PathBuf {
        self.dir.path().join("nri.sock")
    }

    /// A directory for the tests' files (pod logs).
    pub fn dir(&self) -> &Path {
        self.dir.path()
    }

    /// `ctr ARGS` in the `k8s.io` namespace (the CRI's), which must succeed.
    pub fn ctr(&self, args: &[&str]) -> String {
        let out = Command::new(self.bin.join("ctr"))
            .arg("--address")
            .arg(self.socket())
            .args(["--namespace", "k8s.io"])
            .args(args)
            .output()
            .expect("ctr");
        assert!(out.status.success(), "ctr {}: {}", args.join(" "), String::from_utf8_lossy(&out.stderr));
        String::from_utf8_lossy(&out.stdout).into_owned()
    }

    /// A CRI client, as a kubelet has.
    pub async fn cri(&self) -> RuntimeServiceClient<Channel> {
        let channel =
            stasis_proto::unix_channel(&self.socket()).await.expect("connecting to containerd's CRI");
        RuntimeServiceClient::new(channel)
    }

    /// The end of containerd's log.
    pub fn log_tail(&self) -> String {
        let text = std::fs::read_to_string(self.dir.path().join("containerd.log")).unwrap_or_default();
        text.lines().rev().take(30).collect::<Vec<_>>().into_iter().rev().collect::<Vec<_>>().join("\n")
    }
}

impl Drop for Containerd {
    fn drop(&mut self) {
        // Its containers first (their shims outlive it), then containerd, then its mounts.
        for task in self.ctr_list("tasks") {
            let _ = Command::new(self.bin.join("ctr"))
                .arg("--address")
                .arg(self.socket())
                .args(["--namespace", "k8s.io", "tasks", "kill", "-s", "SIGKILL", &task])
                .output();
        }
        std::thread::sleep(Duration::from_millis(300));
        let _ = self.child.kill();
        let _ = self.child.wait();
        let mounts = std::fs::read_to_string("/proc/self/mounts").unwrap_or_default();
        let mine = self.dir.path().display().to_string();
        let mut points: Vec<&str> = mounts
            .lines()
            .filter_map(|l| l.split_whitespace().nth(1))
            .filter(|p| p.starts_with(&mine))
            .collect();
        points.sort_by_key(|p| std::cmp::Reverse(p.len()));
        for point in points {
            let _ = Command::new("umount").arg("-l").arg(point).status();
        }
        // The pods' cgroups (under `k8s.io` in each hierarchy), emptied above.
        let hierarchies = std::fs::read_dir("/sys/fs/cgroup").into_iter().flatten().flatten();
        hierarchies.for_each(|h| remove_cgroups(&h.path().join("k8s.io")));
    }
}

/// Removes the cgroup `dir` and those below it, deepest first; busy ones stay.
fn remove_cgroups(dir: &Path) {
    for entry in std::fs::read_dir(dir).into_iter().flatten().flatten() {
        if entry.file_type().is_ok_and(|t| t.is_dir()) {
            remove_cgroups(&entry.path());
        }
    }
    let _ = std::fs::remove_dir(dir);
}

impl Containerd {
    fn ctr_list(&self, what: &str) -> Vec<String> {
        let out = Command::new(self.bin.join("ctr"))
            .arg("--address")
            .arg(self.socket())
            .args(["--namespace", "k8s.io", what, "ls", "-q"])
            .output();
        out.map(|o| String::from_utf8_lossy(&o.stdout).lines().map(str::to_owned).collect())
            .unwrap_or_default()
    }
}

/// Starts containerd on the configuration in `dir`, logging there (appending).
fn spawn(bin: &Path, dir: &Path) -> Child {
    let log = std::fs::File::options()
        .create(true)
        .append(true)
        .open(dir.join("containerd.log"))
        .expect("containerd log");
    let path = format!("{}:{}", bin.display(), std::env::var("PATH").unwrap_or_default());
    Command::new(bin.join("containerd"))
        .arg("--config")
        .arg(dir.join("config.toml"))
        .env("PATH", path)
        .stdin(Stdio::null())
        .stdout(log.try_clone().expect("log"))
        .stderr(log)
        .spawn()
        .expect("starting containerd")
}

/// containerd's configuration, everything under `dir`.
fn config_for(dir: &Path) -> String {
    let d = dir.display();
    format!(
        r#"version = 2
root = "{d}/root"
state = "{d}/state"
[grpc]
  address = "{d}/containerd.sock"
[ttrpc]
  address = "{d}/containerd.sock.ttrpc"
[plugins."io.containerd.grpc.v1.cri"]
  restrict_oom_score_adj = true
  sandbox_image = "{PAUSE_IMAGE}"
  [plugins."io.containerd.grpc.v1.cri".containerd]
    snapshotter = "overlayfs"
    default_runtime_name = "runc"
    [plugins."io.containerd.grpc.v1.cri".containerd.runtimes.runc]
      runtime_type = "io.containerd.runc.v2"
      [plugins."io.containerd.grpc.v1.cri".containerd.runtimes.runc.options]
        BinaryName = "/usr/sbin/runc"
[plugins."io.containerd.nri.v1.nri"]
  disable = false
  socket_path = "{d}/nri.sock"
  plugin_path = "{d}/nri-plugins"
  plugin_config_path = "{d}/nri-conf"
"#
    )
}
