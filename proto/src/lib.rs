//! Generated protobuf code: the `stasis.v1` gRPC API, the checkpoint manifest, our own
//! definitions of the CRIU RPC messages stasisd exchanges with `criu swrk`, and of the part of
//! Kubernetes' CRI that drives a container runtime.
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

/// The part of the Kubernetes CRI (`runtime.v1.RuntimeService`) stasis uses.
pub mod cri {
    tonic::include_proto!("runtime.v1");
}
