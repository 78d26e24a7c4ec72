//! Linux boundaries: /proc inspection, process spawning, cgroups, signals and child reaping.
//!
//! All unsafe code of this area lives in [`sys`].

pub mod cgroup;
pub mod iptables;
pub mod net;
pub mod nft;
pub mod proc;
pub mod pty;
pub mod reaper;
pub mod sys;
