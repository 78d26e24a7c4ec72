//! What stasis' two init programs share: `stasis-init` (the first process of a workload's own
//! pid namespace) and `stasis-pod` (the first process of a Kubernetes container that opted
//! in). Both start or adopt one workload, pass it the signals meant for it, reap whatever is
//! orphaned to them, and exit as the workload did.
#![deny(unsafe_code)]

pub mod supervise;
#[allow(unsafe_code)] // the only unsafe code: sys.rs
pub mod sys;
