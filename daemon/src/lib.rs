//! stasis-daemon: the engine behind `stasisd`, over the crates of `lib/`.
//!
//! - [`engine`]: the typed domain API (run, checkpoint, restore, list, delete, status);
//! - [`grpc`]: the thin `stasis.v1` adapter over the engine;
//! - [`notice`]: the clouds' preemption notices; [`metrics`]: Prometheus;
//! - [`config`] and [`server`]: the daemon's settings and lifecycle.
//!
//! What the engine drives is in crates of its own, so that none of them can reach up into the
//! engine (the compiler refuses it); each is re-exported here under its module name:
//!
//! ```text
//! stasis-daemon       the engine, the API, the daemon: uses every crate below
//! stasis-store        -> stasis-criu-images, stasis-linux, stasis-errors
//! stasis-criu         -> stasis-criu-images, stasis-linux
//! stasis-cuda         -> stasis-linux
//! stasis-criu-images  CRIU's image formats: bytes and files, no kernel, no CRIU
//! stasis-linux        the kernel
//! ```
//!
//! - [`criu`] (`stasis-criu`): driving CRIU over its swrk RPC (behind the `CriuOps` seam), its
//!   page server and lazy-pages socket, what it can do on this kernel;
//! - [`pages`] and CRIU's image formats (`stasis-criu-images`): a dump's memory as runs of
//!   pages, what [`criu`] receives and [`store`] keeps, and the image files both read;
//! - [`store`] (`stasis-store`): manifests and checkpoint data in object storage;
//! - [`cuda`] (`stasis-cuda`): NVIDIA's driver checkpoint API (loaded at run time), NVML, and
//!   finding CUDA processes;
//! - [`linux`] (`stasis-linux`): /proc, sockets, nftables and iptables locks, cgroups, ptys,
//!   userfaultfd, spawning and reaping.
//!
//! Unsafe code is denied in every crate but in four FFI modules, each allowing it by name:
//! `linux::sys` (system calls and `fork`-time code), `linux::uffd` (userfaultfd ioctls),
//! `cuda::sys` (the driver's checkpoint API, loaded at run time) and `cuda::nvml`.

#![deny(unsafe_code)]

pub mod admission;
pub mod config;
pub mod engine;
pub mod grpc;
pub mod metrics;
pub mod notice;
pub mod server;

pub use stasis_criu as criu;
pub use stasis_criu::pages;
pub use stasis_cuda as cuda;
pub use stasis_errors::error_chain;
pub use stasis_linux as linux;
pub use stasis_store as store;
