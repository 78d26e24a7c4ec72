//! stasis-daemon: the engine behind `stasisd`.
//!
//! - [`engine`]: the typed domain API (run, checkpoint, restore, list, delete, status);
//! - [`grpc`]: the thin `stasis.v1` adapter over the engine;
//! - [`criu`]: driving CRIU over its swrk RPC (behind the `CriuOps` seam), its images and page
//!   server, and what it can do on this kernel;
//! - [`cuda`]: NVIDIA's driver checkpoint API (loaded at run time) and finding CUDA processes;
//! - [`store`]: manifests and checkpoint data in object storage;
//! - [`pages`]: a dump's memory as runs of pages, what [`criu`] receives and [`store`] keeps;
//! - [`linux`]: /proc, sockets, nftables and iptables locks, cgroups, ptys, spawning and
//!   reaping;
//! - [`config`] and [`server`]: the daemon's settings and lifecycle.
//!
//! Unsafe code is denied everywhere but in four FFI modules, each allowing it by name:
//! `linux::sys` (system calls and `fork`-time code), `linux::uffd` (userfaultfd ioctls),
//! `cuda::sys` (the driver's checkpoint API, loaded at run time) and `cuda::nvml`.

#![deny(unsafe_code)]

pub mod admission;
pub mod config;
pub mod criu;
pub mod cuda;
pub mod engine;
pub mod grpc;
pub mod linux;
pub mod metrics;
pub mod notice;
pub mod pages;
pub mod server;
pub mod store;

/// An error and all its sources, joined with ": ".
pub fn error_chain(err: &dyn std::error::Error) -> String {
    let mut out = err.to_string();
    let mut source = err.source();
    while let Some(s) = source {
        out.push_str(": ");
        out.push_str(&s.to_string());
        source = s.source();
    }
    out
}
