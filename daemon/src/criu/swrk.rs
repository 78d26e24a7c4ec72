//! One `criu swrk` session: a CRIU child process and our end of its SEQPACKET socket.

use std::os::fd::{AsRawFd, OwnedFd, RawFd};
use std::path::{Path, PathBuf};
use std::process::{Command, Stdio};

use nix::sys::socket::{AddressFamily, MsgFlags, SockFlag, SockType, recv, send, socketpair};
use prost::Message;
use stasis_proto::criu::{Request, RequestType, Response};
use tracing::debug;

use super::CriuError;
use crate::linux::sys::{ChildSetup, spawn};

/// A running `criu swrk` process.
pub(super) struct Session {
    sock: OwnedFd,
    log_dir: Option<PathBuf>,
}

impl Session {
    /// Starts `criu swrk` with one end of a fresh socketpair; `keep_fds` are passed on to CRIU
    /// under the same numbers (for `ps.fd` and `inherit_fd`).
    pub(super) fn start(criu: &Path, keep_fds: &[RawFd]) -> Result<Self, CriuError> {
        let (ours, theirs) =
            socketpair(AddressFamily::Unix, SockType::SeqPacket, None, SockFlag::SOCK_CLOEXEC)
                .map_err(|e| CriuError::Io(e.into()))?;
        let mut cmd = Command::new(criu);
        // CRIU writes its log to a file in the images directory; its stderr carries only
        // duplicates of that, or "Looks good." from a check.
        cmd.arg("swrk")
            .arg(theirs.as_raw_fd().to_string())
            .stdin(Stdio::null())
            .stdout(Stdio::null())
            .stderr(Stdio::null());
        let mut keep = vec![theirs.as_raw_fd()];
        keep.extend_from_slice(keep_fds);
        let child = spawn(&mut cmd, ChildSetup { keep_fds: keep, ..Default::default() })
            .map_err(|source| CriuError::Spawn { path: criu.to_path_buf(), source })?;
        debug!(pid = child.id(), criu = %criu.display(), "criu swrk started");
        // The reaper collects the child's exit; `Child` is dropped without waiting.
        drop(child);
        Ok(Self { sock: ours, log_dir: None })
    }

    /// Sends `req` and returns CRIU's final answer, answering notifications with success.
    pub(super) fn call(&mut self, req: &Request) -> Result<Response, CriuError> {
        self.call_with_notify(req, &mut |_| Ok(()))
    }

    /// Sends `req`; every NOTIFY answer is passed to `on_notify` and acknowledged with its
    /// outcome, until the final answer arrives.
    pub(super) fn call_with_notify(
        &mut self,
        req: &Request,
        on_notify: &mut dyn FnMut(&str) -> Result<(), String>,
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
            let ok = match on_notify(&script) {
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

/// The path behind an images-directory descriptor of ours, for reading CRIU's log.
fn images_dir_of(fd: Option<i32>) -> Option<PathBuf> {
    std::fs::read_link(format!("/proc/self/fd/{}", fd?)).ok()
}
