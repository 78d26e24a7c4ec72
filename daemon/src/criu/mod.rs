//! Driving CRIU through its RPC interface: `criu swrk <fd>` over an AF_UNIX SOCK_SEQPACKET
//! socketpair, one protobuf message per packet (messages defined in `proto/proto/criu`).
//!
//! [`Criu`] is the typed entry point: version and health checks, dump and restore. Failures
//! carry the relevant tail of CRIU's own log.

mod error;
pub mod images;
pub mod lazy;
mod log;
mod options;
pub mod pageserver;
pub mod support;
mod swrk;

use std::os::fd::{AsRawFd, OwnedFd, RawFd};
use std::path::{Path, PathBuf};

pub use error::{CriuError, log_section};
pub use log::tail_of as log_tail_of;
pub use options::{DumpSpec, RestoreSpec, TreeOptions};
use stasis_proto::criu::{Request, RequestType};
pub use support::NetworkLock;
use swrk::Session;

/// CRIU's version as reported over RPC.
#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord)]
pub struct CriuVersion {
    pub major: i32,
    pub minor: i32,
    pub sublevel: i32,
}

impl std::fmt::Display for CriuVersion {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "{}.{}.{}", self.major, self.minor, self.sublevel)
    }
}

/// The oldest CRIU stasis works with.
pub const MIN_VERSION: CriuVersion = CriuVersion { major: 4, minor: 0, sublevel: 0 };

/// Name of CRIU's log file inside an images directory.
pub const LOG_FILE: &str = "criu.log";

/// A CRIU executable.
#[derive(Debug, Clone)]
pub struct Criu {
    path: PathBuf,
}

impl Criu {
    pub fn new(path: impl Into<PathBuf>) -> Self {
        Self { path: path.into() }
    }

    pub fn path(&self) -> &Path {
        &self.path
    }

    /// Asks CRIU for its version.
    pub fn version(&self) -> Result<CriuVersion, CriuError> {
        let mut session = Session::start(&self.path, &[])?;
        let resp =
            session.call(&Request { r#type: Some(RequestType::Version as i32), ..Default::default() })?;
        let v = resp.version.ok_or(CriuError::Protocol("VERSION answer without a version"))?;
        Ok(CriuVersion {
            major: v.major.unwrap_or(0),
            minor: v.minor.unwrap_or(0),
            sublevel: v.sublevel.unwrap_or(0),
        })
    }

    /// Runs CRIU's self-check of the kernel (`criu check`), logging into `work_dir`.
    pub fn check(&self, work_dir: &Path) -> Result<(), CriuError> {
        let dir = options::open_dir(work_dir)?;
        let req = Request {
            r#type: Some(RequestType::Check as i32),
            opts: Some(options::base_options(dir.as_raw_fd())),
            ..Default::default()
        };
        let mut session = Session::start(&self.path, &[])?;
        let resp = session.call(&req)?;
        error::check_success(&resp, work_dir, "check")
    }

    /// Dumps the tree described by `spec` into `spec.images_dir`. `on_notify` is called for
    /// each CRIU notification (e.g. "pre-dump", "post-dump") while CRIU waits; an error from
    /// it makes CRIU abort the dump.
    pub fn dump(
        &self,
        spec: &DumpSpec,
        mut on_notify: impl FnMut(&str) -> Result<(), String>,
    ) -> Result<(), CriuError> {
        let dir = options::open_dir(&spec.images_dir)?;
        let keep: Vec<RawFd> = spec.page_server_fd.iter().copied().collect();
        let req = Request {
            r#type: Some(RequestType::Dump as i32),
            opts: Some(spec.to_options(dir.as_raw_fd())),
            ..Default::default()
        };
        let mut session = Session::start(&self.path, &keep)?;
        let resp = session.call_with_notify(&req, &mut on_notify)?;
        error::check_success(&resp, &spec.images_dir, "dump")
    }

    /// Restores the tree from `spec.images_dir`; returns the pid of the restored root.
    /// `on_notify` is called for each CRIU notification (e.g. "pre-resume": the tree is
    /// restored and about to run) while CRIU waits.
    pub fn restore(
        &self,
        spec: &RestoreSpec,
        mut on_notify: impl FnMut(&str) -> Result<(), String>,
    ) -> Result<i32, CriuError> {
        let dir = options::open_dir(&spec.images_dir)?;
        let keep: Vec<RawFd> = spec.inherit_fds.iter().map(|(_, fd)| fd.as_raw_fd()).collect();
        let req = Request {
            r#type: Some(RequestType::Restore as i32),
            opts: Some(spec.to_options(dir.as_raw_fd())),
            ..Default::default()
        };
        let mut session = Session::start(&self.path, &keep)?;
        let resp = session.call_with_notify(&req, &mut on_notify)?;
        error::check_success(&resp, &spec.images_dir, "restore")?;
        resp.restore.and_then(|r| r.pid).ok_or(CriuError::Protocol("RESTORE answer without a pid"))
    }
}

/// Keeps descriptors handed to CRIU alive for the duration of a call.
pub type InheritedFd = (String, OwnedFd);
