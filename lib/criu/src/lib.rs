//! Driving CRIU through its RPC interface: `criu swrk <fd>` over an AF_UNIX SOCK_SEQPACKET
//! socketpair, one protobuf message per packet (messages defined in `proto/proto/criu`).
//!
//! [`CriuOps`] is the seam the engine uses: version and health checks, dump and restore (a
//! lazy restore's pages are served by stasisd itself, through `lazy_socket`). [`Criu`] implements it with the real program (failures carry the
//! relevant tail of CRIU's own log); the engine's unit tests implement it with fakes.

#![deny(unsafe_code)]

mod error;
#[cfg(any(test, feature = "testing"))]
pub mod fake;
pub mod lazy_socket;
mod log;
mod options;
pub mod pageserver;
pub mod parasite;
pub mod support;
mod swrk;

use std::os::fd::{AsRawFd, OwnedFd, RawFd};
use std::path::{Path, PathBuf};

pub use error::{CriuError, log_section};
pub use log::tail_of as log_tail_of;
pub use options::{DumpSpec, Enter, RestoreSpec, RunningCriu, TreeOptions};
pub use stasis_criu_images::{cow, image_set, images, pages, running};
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

impl std::str::FromStr for CriuVersion {
    type Err = String;

    /// Parses what `Display` writes ("4.2.1"; "4.2" has sublevel 0).
    fn from_str(s: &str) -> Result<Self, String> {
        let mut parts = s.trim().split('.').map(str::parse::<i32>);
        let mut next = || parts.next().transpose().map_err(|_| format!("{s:?} is not a CRIU version"));
        match (next()?, next()?, next()?) {
            (Some(major), Some(minor), sublevel) => {
                Ok(Self { major, minor, sublevel: sublevel.unwrap_or(0) })
            }
            _ => Err(format!("{s:?} is not a CRIU version")),
        }
    }
}

/// The oldest CRIU stasis works with.
pub const MIN_VERSION: CriuVersion = CriuVersion { major: 4, minor: 0, sublevel: 0 };

/// Name of CRIU's log file inside an images directory.
pub const LOG_FILE: &str = "criu.log";

/// Called with each CRIU notification ("pre-dump", "post-dump", "pre-resume", ...) and the pid
/// of the CRIU process while it waits; an error makes CRIU abort.
pub type OnNotify<'a> = &'a mut dyn FnMut(&str, i32) -> Result<(), String>;

/// What stasisd asks of CRIU. Blocking calls.
pub trait CriuOps: Send + Sync + std::fmt::Debug {
    /// Where the program is, for messages.
    fn path(&self) -> &Path;
    /// CRIU's version.
    fn version(&self) -> Result<CriuVersion, CriuError>;
    /// CRIU's self-check of the kernel (`criu check`), logging into `work_dir`.
    fn check(&self, work_dir: &Path) -> Result<(), CriuError>;
    /// Whether CRIU can lock connections with nftables here (`criu check --feature nftables`).
    fn supports_nftables(&self) -> bool;
    /// Dumps the tree described by `spec` into `spec.images_dir`.
    fn dump(&self, spec: &DumpSpec, on_notify: OnNotify<'_>) -> Result<(), CriuError>;
    /// Restores the tree from `spec.images_dir`; returns the pid of the restored root.
    fn restore(&self, spec: &RestoreSpec, on_notify: OnNotify<'_>) -> Result<i32, CriuError>;
}

/// A CRIU executable.
#[derive(Debug, Clone)]
pub struct Criu {
    path: PathBuf,
}

impl Criu {
    pub fn new(path: impl Into<PathBuf>) -> Self {
        Self { path: path.into() }
    }
}

impl CriuOps for Criu {
    fn path(&self) -> &Path {
        &self.path
    }

    fn supports_nftables(&self) -> bool {
        support::nftables_supported(&self.path)
    }

    fn version(&self) -> Result<CriuVersion, CriuError> {
        let mut session = Session::start(&self.path, &[], None)?;
        let resp =
            session.call(&Request { r#type: Some(RequestType::Version as i32), ..Default::default() })?;
        let v = resp.version.ok_or(CriuError::Protocol("VERSION answer without a version"))?;
        Ok(CriuVersion {
            major: v.major.unwrap_or(0),
            minor: v.minor.unwrap_or(0),
            sublevel: v.sublevel.unwrap_or(0),
        })
    }

    fn check(&self, work_dir: &Path) -> Result<(), CriuError> {
        let dir = options::open_dir(work_dir)?;
        let req = Request {
            r#type: Some(RequestType::Check as i32),
            opts: Some(options::base_options(dir.as_raw_fd(), false)),
            ..Default::default()
        };
        let mut session = Session::start(&self.path, &[], None)?;
        let resp = session.call(&req)?;
        error::check_success(&resp, work_dir, "check")
    }

    fn dump(&self, spec: &DumpSpec, on_notify: OnNotify<'_>) -> Result<(), CriuError> {
        let dir = options::open_dir(&spec.images_dir)?;
        let mut keep: Vec<RawFd> = spec.page_server_fd.iter().copied().collect();
        keep.extend(spec.enter.as_ref().map(|_| dir.as_raw_fd()));
        let req = Request {
            r#type: Some(RequestType::Dump as i32),
            opts: Some(spec.to_options(dir.as_raw_fd())),
            ..Default::default()
        };
        let mut session = Session::start(&self.path, &keep, spec.enter.as_ref())?;
        let resp = session.call_with_notify(&req, on_notify)?;
        error::check_success(&resp, &spec.images_dir, "dump")
    }

    fn restore(&self, spec: &RestoreSpec, on_notify: OnNotify<'_>) -> Result<i32, CriuError> {
        let dir = options::open_dir(&spec.images_dir)?;
        let mut keep: Vec<RawFd> = spec.inherit_fds.iter().map(|(_, fd)| fd.as_raw_fd()).collect();
        keep.extend(spec.enter.as_ref().map(|_| dir.as_raw_fd()));
        let req = Request {
            r#type: Some(RequestType::Restore as i32),
            opts: Some(spec.to_options(dir.as_raw_fd())),
            ..Default::default()
        };
        let mut session = Session::start(&self.path, &keep, spec.enter.as_ref())?;
        let running =
            |pid| spec.running.iter().for_each(|r| r.store(pid, std::sync::atomic::Ordering::SeqCst));
        running(session.pid());
        let resp = session.call_with_notify(&req, on_notify);
        running(0);
        let resp = resp?;
        error::check_success(&resp, &spec.images_dir, "restore")?;
        resp.restore.and_then(|r| r.pid).ok_or(CriuError::Protocol("RESTORE answer without a pid"))
    }
}

/// Keeps descriptors handed to CRIU alive for the duration of a call.
pub type InheritedFd = (String, OwnedFd);
