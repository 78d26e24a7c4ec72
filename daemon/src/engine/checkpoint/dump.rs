//! Running a CRIU dump with stasisd's in-process page server: CRIU gets one end of a stream
//! socketpair as its page-server connection, a thread on the other end hands every page to a
//! sink (staging, or the store itself), so no page data becomes an image file.

use std::os::fd::AsRawFd;
use std::sync::Arc;

use nix::sys::socket::{setsockopt, sockopt};
use std::os::unix::net::UnixStream;
use std::time::Instant;

use crate::criu::pageserver::{self, HeaderLayout, PageServerError};
use crate::criu::{CriuError, CriuOps, CriuVersion, DumpSpec};
use crate::engine::CheckpointError;
use crate::engine::host::Host;
use crate::pages::{InParent, PageSink};
use crate::store::ParentMemory;

/// Send and receive buffer of the page-server socketpair.
const SOCKET_BUFFER: usize = 8 << 20;

/// Name of the spill file in the job's work directory (which is CRIU's images directory: the
/// file must be left out when the images are stored).
pub(super) const SPILL_FILE: &str = "pages.spill";

/// Why a dump failed.
#[derive(Debug)]
pub(super) enum DumpFailure {
    Criu(CriuError),
    PageServer(PageServerError),
    Local(&'static str, std::io::Error),
}

impl DumpFailure {
    pub(super) fn into_error(self, workload: String) -> CheckpointError {
        match self {
            Self::Criu(source) => CheckpointError::Dump { workload, source },
            Self::PageServer(source) => CheckpointError::PageServer { workload, source },
            Self::Local(what, source) => CheckpointError::Local { what, source },
        }
    }
}

/// Dumps `spec` (its images directory gets the non-page images) and passes its pages to
/// `sink` as CRIU sends them. Returns when CRIU froze the tree (its "pre-dump" notification)
/// and the sink, for the caller to finish. Blocking.
pub(super) fn dump<S: PageSink + Send + 'static>(
    criu: &dyn CriuOps,
    version: CriuVersion,
    mut spec: DumpSpec,
    mut sink: S,
    parent: Option<Arc<ParentMemory>>,
) -> Result<(Option<Instant>, S), DumpFailure> {
    let layout = HeaderLayout::for_version(version.major, version.minor);
    let (mut ours, theirs) = UnixStream::pair().map_err(|e| DumpFailure::Local("page-server socket", e))?;
    // Large buffers let CRIU stream pages without waiting on our thread at every few hundred
    // KiB (the default); the forced variants need CAP_NET_ADMIN, so failure only costs speed.
    let _ = setsockopt(&ours, sockopt::RcvBufForce, &SOCKET_BUFFER);
    let _ = setsockopt(&theirs, sockopt::SndBufForce, &SOCKET_BUFFER);
    let server = std::thread::Builder::new()
        .name("stasis-pageserver".into())
        .spawn(move || {
            let parent = parent.as_deref().map(|p| p as &dyn InParent);
            pageserver::serve(&mut ours, layout, &mut sink, parent).map(|_| sink)
        })
        .map_err(|e| DumpFailure::Local("page-server thread", e))?;
    spec.page_server_fd = Some(theirs.as_raw_fd());
    let mut frozen_at = None;
    let dumped = criu.dump(&spec, &mut |script, _| {
        if script == "pre-dump" {
            frozen_at = Some(Instant::now());
        }
        Ok(())
    });
    // CRIU has exited; dropping our copy of its end lets the server see the end of the stream.
    drop(theirs);
    let served = server
        .join()
        .map_err(|_| DumpFailure::Local("page-server thread", std::io::Error::other("panicked")))?;
    match (dumped, served) {
        (Ok(()), Ok(sink)) => Ok((frozen_at, sink)),
        // Taking the pages failed (a full spill disk, a stopped store): CRIU failed because
        // of it.
        (_, Err(e @ PageServerError::Sink(_))) => Err(DumpFailure::PageServer(e)),
        (Err(e), _) => Err(DumpFailure::Criu(e)),
        (Ok(()), Err(e)) => Err(DumpFailure::PageServer(e)),
    }
}

/// A default bound for staged pages: a quarter of the memory of the machine `host` runs on.
pub fn default_staging_limit(host: &dyn Host) -> u64 {
    host.memory_total().map(|total| total / 4).unwrap_or(1 << 30)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn staging_default_is_a_quarter_of_memory() {
        let host = crate::engine::host::fake::FakeHost::default();
        assert_eq!(default_staging_limit(&host), host.memory_total().unwrap() / 4);
    }
}
