//! Generated protobuf code: the `stasis.v1` gRPC API, the checkpoint manifest, and our own
//! definitions of the CRIU RPC messages stasisd exchanges with `criu swrk`.
#![forbid(unsafe_code)]
#![allow(clippy::all, missing_docs)]

pub use prost;
pub use tonic;

/// The `stasis.v1` API and manifest messages; those the CLI prints as JSON also derive
/// `serde::Serialize` (see build.rs).
pub mod stasis {
    pub mod v1 {
        tonic::include_proto!("stasis.v1");
    }
}

/// CRIU's RPC messages (`criu swrk`), as far as stasis uses them.
pub mod criu {
    tonic::include_proto!("criu");
}
