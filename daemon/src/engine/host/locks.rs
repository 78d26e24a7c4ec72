//! What undoing CRIU's network lock asks of the kernel (see `engine/sockets/rollback.rs` and
//! `left_locks.rs`): deleting the nftables table it locked a dump's connections in, and
//! running the iptables commands that delete its rules. [`super::LinuxHost`] does it with
//! netlink and stasisd's reaper.

use std::io;
use std::process::Command;

use async_trait::async_trait;

use crate::linux::reaper::{ExitKind, Reaper};

/// The kernel's firewall, for the network locks CRIU leaves.
#[async_trait]
pub trait NetworkLocks: Send + Sync {
    /// Deletes the nftables table `name` of the `inet` family: whether it was there.
    fn delete_inet_table(&self, name: &str) -> io::Result<bool>;
    /// Runs `cmd`, an iptables (or ip6tables) command, to its end through `reaper`: how it
    /// ended, and what it wrote to stderr.
    async fn run_iptables(&self, reaper: &Reaper, cmd: Command) -> io::Result<(ExitKind, String)>;
}
