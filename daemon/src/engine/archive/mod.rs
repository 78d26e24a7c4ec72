//! Container checkpoint archives in and out of the store (`stasis import`, `stasis export`):
//! the layout Podman, CRI-O and the kubelet's checkpoint API write and `checkpointctl` reads.

mod export;
mod import;
pub mod layout;
mod runtime;

use std::path::PathBuf;

pub use layout::Compression;

use crate::store::StoreError;

/// A written archive.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct ExportOutcome {
    pub id: String,
    pub path: PathBuf,
    pub bytes: u64,
    /// Its entries, in the order written.
    pub files: Vec<String>,
}

/// A checkpoint taken in from an archive.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct ImportOutcome {
    pub id: String,
    pub workload: String,
    /// Who wrote the archive: "podman", "cri-o", "containerd" or "stasis".
    pub engine: String,
    /// The archive's paths taken in.
    pub kept: Vec<String>,
    pub bytes_total: u64,
    pub bytes_uploaded: u64,
    /// How it can be restored here, or why it cannot.
    pub restore: String,
}

/// `import` or `export` failed.
#[derive(Debug, thiserror::Error)]
pub enum ArchiveError {
    #[error("import and export are root's: stasisd reads and writes the archive as root")]
    RootOnly,
    #[error("{0:?} is not a checkpoint id")]
    BadId(String),
    #[error("cannot use {path} for the archive: {why}")]
    BadPath { path: PathBuf, why: String },
    #[error("invalid workload name {0:?}: use up to 100 letters, digits, '-', '_' or '.' (--workload)")]
    BadWorkload(String),
    #[error("the archive is not one stasis can take in: {0}")]
    Malformed(String),
    #[error(
        "the archive unpacks to more than the {free} bytes free in {dir} (its entries say so before any is written out)"
    )]
    TooBig { dir: PathBuf, free: u64 },
    #[error("the store failed")]
    Store(#[source] Box<StoreError>),
    #[error("cannot use {what} on this node")]
    Local {
        what: &'static str,
        #[source]
        source: std::io::Error,
    },
}

impl From<StoreError> for ArchiveError {
    fn from(e: StoreError) -> Self {
        Self::Store(Box::new(e))
    }
}

impl ArchiveError {
    fn local(what: &'static str) -> impl Fn(std::io::Error) -> Self {
        move |source| Self::Local { what, source }
    }

    /// The archive is malformed, `why`: text that may quote the archive's own bytes (a tar
    /// header's field, a path), so control characters (and the stand-ins for bytes that were
    /// not UTF-8) are shown escaped, and it is cut to a few lines' length: it reaches a
    /// terminal or a log as text.
    fn malformed(why: String) -> Self {
        const LONGEST: usize = 400;
        let mut shown = String::new();
        for c in why.chars() {
            if shown.len() >= LONGEST {
                shown.push_str("...");
                break;
            }
            match c.is_control() || c == char::REPLACEMENT_CHARACTER {
                true => shown.extend(c.escape_unicode()),
                false => shown.push(c),
            }
        }
        Self::Malformed(shown)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn an_archives_bytes_in_an_error_are_escaped_and_cut() {
        let quoted = String::from_utf8_lossy(
            b"numeric field was not a number: \x1b]0;owned\x07\x00\xff when getting cksum",
        );
        let shown = ArchiveError::malformed(quoted.into_owned()).to_string();
        assert!(!shown.chars().any(|c| c.is_control()), "{shown:?}");
        assert!(shown.contains(r"\u{1b}]0;owned\u{7}\u{0}\u{fffd} when getting cksum"), "{shown}");
        let long = ArchiveError::malformed("x".repeat(5000)).to_string();
        assert!(long.len() < 500 && long.ends_with("..."), "{}", long.len());
    }
}
