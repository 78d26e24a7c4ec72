//! The API's side of `stasis import` and `stasis export`.

use stasis_proto::stasis::v1 as pb;
use tonic::{Code, Status};

use super::convert::{status, store_code};
use crate::engine::archive::{ArchiveError, ExportOutcome, ImportOutcome};

impl From<ArchiveError> for Status {
    fn from(e: ArchiveError) -> Self {
        let code = match &e {
            ArchiveError::RootOnly => Code::PermissionDenied,
            ArchiveError::BadId(_) | ArchiveError::BadPath { .. } | ArchiveError::BadWorkload(_) => {
                Code::InvalidArgument
            }
            ArchiveError::Malformed(_) => Code::InvalidArgument,
            ArchiveError::TooBig { .. } => Code::ResourceExhausted,
            ArchiveError::Store(s) => store_code(s),
            ArchiveError::Local { .. } => Code::Internal,
        };
        status(code, &e)
    }
}

impl From<ExportOutcome> for pb::ExportResponse {
    fn from(o: ExportOutcome) -> Self {
        Self { id: o.id, path: o.path.display().to_string(), bytes: o.bytes, files: o.files }
    }
}

impl From<ImportOutcome> for pb::ImportResponse {
    fn from(o: ImportOutcome) -> Self {
        Self {
            id: o.id,
            workload: o.workload,
            engine: o.engine,
            kept: o.kept,
            bytes_total: o.bytes_total,
            bytes_uploaded: o.bytes_uploaded,
            restore: o.restore,
        }
    }
}
