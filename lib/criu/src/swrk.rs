//! One `criu swrk` session: a CRIU child process and our end of its SEQPACKET socket.

use std::os::fd::{AsFd, AsRawFd, OwnedFd, RawFd};
use std::path::{Path, PathBuf};
use std::process::{Command, Stdio};

use nix::poll::{PollFd, PollFlags, PollTimeout, poll};
use nix::sys::socket::{AddressFamily, MsgFlags, SockFlag, SockType, recv, send, socketpair};
use prost::Message;
use stasis_proto::criu::{Request, RequestType, Response};
use tracing::debug;

use super::{CriuError, Enter};
use stasis_linux::sys::{ChildSetup, spawn};
use stasis_linux::{net, proc};

/// A running `criu swrk` process.
pub(super) struct Session {
    sock: OwnedFd,
    log_dir: Option<PathBuf>,
    /// The `criu swrk` process.
    pid: i32,
    /// The inode of CRIU's end of the socket: a helper CRIU forked may hold it too.
    peer_inode: u64,
}

/// What enters a container's namespaces for CRIU (util-linux).
const NSENTER: &str = "nsenter";
/// The pod bundle's library that moves CRIU into the container's root, as the bundle's root
/// names it, and the variable naming the descriptor of that root (`lib/enter-root`).
const ENTER_ROOT: &str = "/libstasis_enter_root.so";
const ENTER_ROOT_FD: &str = "STASIS_ENTER_ROOT_FD";
/// The `PATH` of a CRIU in a container, below the bundle as the container mounts it (read-only):
/// CRIU runs helper programs by name (`sh -c "iptables -w ..."` when it probes the kernel,
/// `ip`, `tar`), and found in the container's root each would be the image's program, run as
/// root with every capability. This names the bundle's CRIU, a file, so no program is ever
/// found under it: CRIU's probes fail and it does without (stasis uses none of what they are
/// for in a container, whose network and mount namespaces it leaves to the runtime).
const NO_PROGRAMS: &str = "criu";
/// The variable naming CRIU's plugin directory, and the bundle's empty one it names for a CRIU
/// in a container: CRIU loads every `*.so` there once in the container's root, where its
/// default (`/usr/lib/criu`) is the image's.
const PLUGINS_VAR: &str = "CRIU_LIBS_DIR";
const NO_PLUGINS: &str = "plugins";

/// Refuses a pod bundle that lacks what keeps the image out of CRIU (one made by an older
/// `scripts/pod-bundle.sh`): CRIU would fail on it with no word of why.
fn check_bundle(bundle: &Path) -> Result<(), CriuError> {
    let shim = bundle.join(ENTER_ROOT.trim_start_matches('/'));
    let plugins = bundle.join(NO_PLUGINS);
    let missing: Vec<String> = [(shim.is_file(), shim), (plugins.is_dir(), plugins)]
        .into_iter()
        .filter_map(|(there, path)| (!there).then(|| path.display().to_string()))
        .collect();
    match missing.is_empty() {
        true => Ok(()),
        false => Err(CriuError::Bundle { missing: missing.join(", ") }),
    }
}

/// Opens the `cgroup.procs` files a CRIU joins before it runs.
fn open_cgroups(files: &[PathBuf]) -> Result<Vec<std::fs::File>, CriuError> {
    let open = |file: &PathBuf| std::fs::OpenOptions::new().write(true).open(file);
    files.iter().map(|f| open(f).map_err(|source| CriuError::Cgroup { file: f.clone(), source })).collect()
}

/// How often a wait for CRIU's answer checks that CRIU is still there.
const LIVENESS_EVERY_MS: u16 = 1000;

impl Session {
    /// Starts `criu swrk` with one end of a fresh socketpair; `keep_fds` are passed on to CRIU
    /// under the same numbers (for `ps.fd`, `inherit_fd` and an entered images directory).
    /// With `enter`, CRIU runs inside a container (`nsenter` forks it there), started from
    /// the container's mount of the pod bundle as its root (see [`Enter`]).
    pub(super) fn start(criu: &Path, keep_fds: &[RawFd], enter: Option<&Enter>) -> Result<Self, CriuError> {
        let (ours, theirs) =
            socketpair(AddressFamily::Unix, SockType::SeqPacket, None, SockFlag::SOCK_CLOEXEC)
                .map_err(|e| CriuError::Io(e.into()))?;
        let (mut cmd, cgroups, root) = match enter {
            None => (Command::new(criu), Vec::new(), None),
            Some(enter) => {
                // The container's root, and the bundle in it, as this host reaches them.
                let root = PathBuf::from(format!("/proc/{}/root", enter.pid));
                let bundle = root.join(enter.bundle.strip_prefix("/").unwrap_or(&enter.bundle));
                check_bundle(&bundle)?;
                let root = std::fs::File::open(&root)
                    .map_err(|source| CriuError::Spawn { path: root.clone(), source })?;
                // Found here, in stasisd's PATH: the one set below is CRIU's.
                let nsenter = stasis_linux::find_program(NSENTER).ok_or_else(|| CriuError::Spawn {
                    path: NSENTER.into(),
                    source: std::io::Error::new(std::io::ErrorKind::NotFound, "not in stasisd's PATH"),
                })?;
                let mut cmd = Command::new(nsenter);
                let (root_opt, wd_opt) =
                    (format!("--root={}", bundle.display()), format!("--wd={}", bundle.display()));
                cmd.args(["--target", &enter.pid.to_string(), "--all", &root_opt, &wd_opt, "--"])
                    .args(["/ld.so", "--preload", ENTER_ROOT, "--library-path", "/lib", "/criu"])
                    // CRIU reads /etc/criu/default.conf and ~/.criu/default.conf (and the file
                    // CRIU_CONFIG_FILE names) wherever its root is: in the container's, they are
                    // the image's, and could name plugins or action scripts to run as root.
                    .arg("--no-default-config")
                    .env_remove("CRIU_CONFIG_FILE")
                    .env(ENTER_ROOT_FD, root.as_raw_fd().to_string())
                    .env("PATH", enter.bundle.join(NO_PROGRAMS))
                    .env(PLUGINS_VAR, enter.bundle.join(NO_PLUGINS));
                (cmd, open_cgroups(&enter.cgroups)?, Some(root))
            }
        };
        // CRIU writes its log to a file in the images directory; its stderr carries only
        // duplicates of that, or "Looks good." from a check.
        cmd.arg("swrk")
            .arg(theirs.as_raw_fd().to_string())
            .stdin(Stdio::null())
            .stdout(Stdio::null())
            .stderr(Stdio::null());
        let mut keep = vec![theirs.as_raw_fd()];
        keep.extend_from_slice(keep_fds);
        keep.extend(root.as_ref().map(AsRawFd::as_raw_fd));
        let peer_inode = nix::sys::stat::fstat(&theirs).map_err(|e| CriuError::Io(e.into()))?.st_ino;
        let cgroup_procs = cgroups.iter().map(AsRawFd::as_raw_fd).collect();
        let child = spawn(&mut cmd, ChildSetup { keep_fds: keep, cgroup_procs, ..Default::default() })
            .map_err(|source| CriuError::Spawn { path: criu.to_path_buf(), source })?;
        debug!(pid = child.id(), criu = %criu.display(), ?enter, "criu swrk started");
        let pid = child.id() as i32;
        // The reaper collects the child's exit; `Child` is dropped without waiting.
        drop(child);
        Ok(Self { sock: ours, log_dir: None, pid, peer_inode })
    }

    /// The `criu swrk` process (the launcher, in a container).
    pub(super) fn pid(&self) -> i32 {
        self.pid
    }

    /// Sends `req` and returns CRIU's final answer, answering notifications with success.
    pub(super) fn call(&mut self, req: &Request) -> Result<Response, CriuError> {
        self.call_with_notify(req, &mut |_, _| Ok(()))
    }

    /// Sends `req`; every NOTIFY answer is passed to `on_notify` and acknowledged with its
    /// outcome, until the final answer arrives.
    pub(super) fn call_with_notify(
        &mut self,
        req: &Request,
        on_notify: super::OnNotify<'_>,
    ) -> Result<Response, CriuError> {
        if let Some(opts) = &req.opts {
            self.log_dir = images_dir_of(opts.images_dir_fd);
        }
        self.send(req)?;
        loop {
            let resp = self.recv()?;
            if resp.r#type != Some(RequestType::Notify as i32) {
                return Ok(resp);
            }
            let script = resp.notify.and_then(|n| n.script).unwrap_or_default();
            debug!(script, "criu notification");
            let ok = match on_notify(&script, self.pid) {
                Ok(()) => true,
                Err(reason) => {
                    tracing::warn!(script, reason, "aborting CRIU at notification");
                    false
                }
            };
            self.send(&Request {
                r#type: Some(RequestType::Notify as i32),
                notify_success: Some(ok),
                ..Default::default()
            })?;
        }
    }

    fn send(&self, req: &Request) -> Result<(), CriuError> {
        let buf = req.encode_to_vec();
        send(self.sock.as_raw_fd(), &buf, MsgFlags::MSG_NOSIGNAL).map_err(|e| CriuError::Io(e.into()))?;
        Ok(())
    }

    fn recv(&self) -> Result<Response, CriuError> {
        self.wait_readable()?;
        let fd = self.sock.as_raw_fd();
        let mut probe = [0u8; 1];
        let len = loop {
            match recv(fd, &mut probe, MsgFlags::MSG_PEEK | MsgFlags::MSG_TRUNC) {
                Err(nix::Error::EINTR) => continue,
                other => break other.map_err(|e| CriuError::Io(e.into()))?,
            }
        };
        if len == 0 {
            let log_tail = self.log_dir.as_deref().map(super::log::tail).unwrap_or_default();
            return Err(CriuError::Exited { log_tail });
        }
        let mut buf = vec![0u8; len];
        let got = recv(fd, &mut buf, MsgFlags::empty()).map_err(|e| CriuError::Io(e.into()))?;
        Response::decode(&buf[..got]).map_err(|_| CriuError::Protocol("undecodable message"))
    }
}

impl Session {
    /// Waits until CRIU's answer (or its end of the socket closing) can be read. A CRIU that
    /// died leaves no end-of-file behind if a helper it forked still holds the socket (as it
    /// does when CRIU is killed mid-dump): once CRIU itself is gone, such helpers are killed
    /// and the session ends as if CRIU had closed it.
    fn wait_readable(&self) -> Result<(), CriuError> {
        loop {
            let mut fds = [PollFd::new(self.sock.as_fd(), PollFlags::POLLIN)];
            match poll(&mut fds, PollTimeout::from(LIVENESS_EVERY_MS)) {
                Ok(0) if !proc::is_running(self.pid) => {
                    self.kill_leftovers();
                    let log_tail = self.log_dir.as_deref().map(super::log::tail).unwrap_or_default();
                    return Err(CriuError::Exited { log_tail });
                }
                Ok(0) | Err(nix::Error::EINTR) => continue,
                Ok(_) => return Ok(()),
                Err(e) => return Err(CriuError::Io(e.into())),
            }
        }
    }

    /// Kills the processes (CRIU's orphaned helpers) that hold CRIU's end of the socket.
    fn kill_leftovers(&self) {
        let ours = std::process::id() as i32;
        let holders: Vec<i32> = net::socket_holders(self.peer_inode)
            .into_iter()
            .map(|(pid, _)| pid)
            .filter(|&p| p != ours)
            .collect();
        if !holders.is_empty() {
            tracing::warn!(criu = self.pid, helpers = ?holders, "CRIU died leaving helpers behind; killing them");
            proc::signal_all(&holders, nix::sys::signal::Signal::SIGKILL);
        }
    }
}

/// The path behind an images-directory descriptor of ours, for reading CRIU's log.
fn images_dir_of(fd: Option<i32>) -> Option<PathBuf> {
    std::fs::read_link(format!("/proc/self/fd/{}", fd?)).ok()
}

#[cfg(test)]
mod tests {
    use std::os::unix::fs::PermissionsExt;
    use std::time::{Duration, Instant};

    use super::*;

    #[test]
    fn a_criu_that_dies_leaving_a_helper_with_the_socket_ends_the_session() {
        // A "CRIU" that forks a helper (inheriting the socket) and dies without answering.
        let dir = tempfile::tempdir().unwrap();
        let criu = dir.path().join("criu");
        std::fs::write(&criu, "#!/bin/sh\nsleep 600 &\necho $! > \"$(dirname \"$0\")/helper\"\nexit 0\n")
            .unwrap();
        std::fs::set_permissions(&criu, std::fs::Permissions::from_mode(0o755)).unwrap();
        let mut session = Session::start(&criu, &[], None).unwrap();
        let started = Instant::now();
        let err = session.call(&Request::default()).unwrap_err();
        assert!(matches!(err, CriuError::Exited { .. }), "{err}");
        assert!(started.elapsed() < Duration::from_secs(10), "took {:?}", started.elapsed());
        let helper: i32 = std::fs::read_to_string(dir.path().join("helper")).unwrap().trim().parse().unwrap();
        let gone = (0..50).any(|_| {
            std::thread::sleep(Duration::from_millis(20));
            !proc::is_running(helper)
        });
        assert!(gone, "the helper holding the socket was left running");
    }

    #[test]
    fn a_bundle_without_the_root_shim_or_the_empty_plugin_directory_is_refused_by_name() {
        let dir = tempfile::tempdir().unwrap();
        let missing = |dir: &Path| match check_bundle(dir) {
            Err(CriuError::Bundle { missing }) => missing,
            other => panic!("{other:?}"),
        };
        let (shim, plugins) = (dir.path().join("libstasis_enter_root.so"), dir.path().join("plugins"));
        assert_eq!(missing(dir.path()), format!("{}, {}", shim.display(), plugins.display()));
        std::fs::write(&shim, "").unwrap();
        assert_eq!(missing(dir.path()), plugins.display().to_string());
        std::fs::create_dir(&plugins).unwrap();
        check_bundle(dir.path()).expect("a whole bundle");
    }
}
