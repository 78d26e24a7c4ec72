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
}
