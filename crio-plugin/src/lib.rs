//! stasis-nri: the NRI plugin that keeps stasisd informed of Kubernetes containers opted in to
//! stasis, for CRI-O and containerd. It injects the pod bundle and the pod endpoint into an
//! opted-in container as it is created, registers it with stasisd once it runs (its identity,
//! image and init's pid), reports containers that stop unplanned, and forgets removed ones.
//!
//! NRI has no Rust library: the protocol is spoken here, ttRPC messages (`ttrpc.rs`) over
//! NRI's multiplexed socket (`mux.rs`).
#![forbid(unsafe_code)]

pub mod inventory;
pub mod mux;
pub mod plugin;
pub mod stasisd;
pub mod ttrpc;
