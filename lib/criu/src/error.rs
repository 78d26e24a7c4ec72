//! CRIU failures, with the relevant part of CRIU's log.

use std::io;
use std::path::{Path, PathBuf};

use stasis_proto::criu::Response;

/// A CRIU operation failed.
#[derive(Debug, thiserror::Error)]
pub enum CriuError {
    #[error("cannot start CRIU at {path}")]
    Spawn {
        path: PathBuf,
        #[source]
        source: io::Error,
    },
    #[error("cannot join the container's cgroup ({file})")]
    Cgroup {
        file: PathBuf,
        #[source]
        source: io::Error,
    },
    #[error(
        "the container's pod bundle lacks {missing}: rebuild it with this version's \
         scripts/pod-bundle.sh and copy libstasis_enter_root.so into it"
    )]
    Bundle { missing: String },
    #[error("cannot talk to CRIU")]
    Io(#[source] io::Error),
    #[error("CRIU exited before answering{}", log_suffix(.log_tail))]
    Exited { log_tail: String },
    #[error("unexpected answer from CRIU: {0}")]
    Protocol(&'static str),
    #[error("CRIU's {0} did not get ready within {1:?}")]
    Timeout(&'static str, std::time::Duration),
    #[error("cannot open images directory {path}")]
    ImagesDir {
        path: PathBuf,
        #[source]
        source: nix::Error,
    },
    #[error("CRIU {operation} failed: {message}{}", log_suffix(.log_tail))]
    Failed { operation: &'static str, message: String, log_tail: String },
}

impl CriuError {
    /// The tail of CRIU's log carried by this error, if any.
    pub fn log_tail(&self) -> Option<&str> {
        match self {
            Self::Exited { log_tail } | Self::Failed { log_tail, .. } if !log_tail.is_empty() => {
                Some(log_tail)
            }
            _ => None,
        }
    }
}

fn log_suffix(tail: &str) -> String {
    log_section("CRIU log", tail)
}

/// `tail` under a heading naming the log, for appending to an error; empty without a tail.
pub fn log_section(log: &str, tail: &str) -> String {
    if tail.is_empty() { String::new() } else { format!("\n--- {log} (tail) ---\n{tail}") }
}

/// Turns an unsuccessful answer into [`CriuError::Failed`]. Success is the `success` field
/// alone: a successful answer may still carry a harmless `cr_errmsg` warning.
pub(super) fn check_success(
    resp: &Response,
    log_dir: &Path,
    operation: &'static str,
) -> Result<(), CriuError> {
    if resp.success.unwrap_or(false) {
        return Ok(());
    }
    let reported = resp.cr_errmsg.clone().filter(|m| !super::log::is_benign(m));
    let mut message = reported.or_else(|| super::log::first_error(log_dir)).unwrap_or_default();
    if let Some(errno) = resp.cr_errno.filter(|e| *e != 0) {
        let errno = nix::errno::Errno::from_raw(errno);
        message = if message.is_empty() { errno.to_string() } else { format!("{message} ({errno})") };
    }
    if message.is_empty() {
        message = "no reason given".into();
    }
    Err(CriuError::Failed { operation, message, log_tail: super::log::tail(log_dir) })
}
