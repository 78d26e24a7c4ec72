//! GPU test workloads for stasis. They run on a GPU machine (driven by `run_gpu_tests.sh`
//! beside this crate) and are built anywhere: CUDA is loaded at run time through cudarc's
//! `dynamic-loading`, and the kernels are PTX text JIT-compiled by the driver, so building
//! needs neither the CUDA toolkit nor nvcc.
//!
//! - `stasis-gpu-memtest`: fills device memory with a known pattern and verifies it
//!   periodically, printing a checksum that must survive a checkpoint and restore;
//! - `stasis-gpu-probe`: drives the daemon's `cuda` module by hand (GPU list, process states,
//!   lock/checkpoint/restore/unlock of a pid).

pub mod pattern;
pub mod sys;
