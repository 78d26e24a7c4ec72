//! Generated protobuf code: the `stasis.v1` gRPC API, the store's format (`stasis.store.v1`:
//! the checkpoint manifest and pack indexes, versioned apart from the API), our own
//! definitions of the CRIU RPC messages stasisd exchanges with `criu swrk`, of the part of
//! Kubernetes' CRI that drives a container runtime, and of NRI's plugin protocol; and the
//! connection to a gRPC server on a Unix socket.
#![forbid(unsafe_code)]
#![allow(clippy::all, missing_docs)]

pub use prost;
pub use tonic;

pub mod stasis {
    /// The `stasis.v1` API messages; those the CLI prints as JSON also derive
    /// `serde::Serialize` (see build.rs).
    pub mod v1 {
        tonic::include_proto!("stasis.v1");
    }

    /// What the store holds: the checkpoint manifest and pack indexes (`stasis.store.v1`).
    pub mod store {
        pub mod v1 {
            tonic::include_proto!("stasis.store.v1");
        }
    }
}

/// CRIU's RPC messages (`criu swrk`), as far as stasis uses them.
pub mod criu {
    tonic::include_proto!("criu");

    /// What stasisd reads of CRIU's images to follow which images refer to which.
    pub mod refs {
        tonic::include_proto!("criu.refs");
    }
}

/// The part of the Kubernetes CRI (`runtime.v1.RuntimeService`) stasis uses.
pub mod cri {
    tonic::include_proto!("runtime.v1");
}

/// NRI's plugin protocol (`nri.pkg.api.v1alpha1`), as far as stasis-nri speaks it.
pub mod nri {
    tonic::include_proto!("nri.pkg.api.v1alpha1");
}

/// ttRPC's envelope, which carries NRI's messages.
pub mod ttrpc {
    tonic::include_proto!("ttrpc");
}

/// A gRPC channel to the server on Unix socket `path` (stasisd, a container runtime).
pub async fn unix_channel(
    path: &std::path::Path,
) -> Result<tonic::transport::Channel, tonic::transport::Error> {
    let path = path.to_path_buf();
    // The URI is required by the HTTP/2 layer but unused: the connector ignores it.
    tonic::transport::Endpoint::from_static("http://[::]:50051")
        .connect_with_connector(tower::service_fn(move |_| {
            let path = path.clone();
            async move {
                let stream = tokio::net::UnixStream::connect(path).await?;
                Ok::<_, std::io::Error>(hyper_util::rt::TokioIo::new(stream))
            }
        }))
        .await
}
