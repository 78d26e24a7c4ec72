//! The fake's firewall: the nftables tables CRIU's locks are (a test makes them), and the
//! iptables commands stasisd runs to remove its rules.

use std::collections::HashSet;
use std::io;
use std::process::Command;
use std::sync::Mutex;

use async_trait::async_trait;

use super::NetworkLocks;
use super::fake::FakeHost;
use crate::linux::reaper::{ExitKind, Reaper};

#[derive(Debug, Default)]
pub struct FakeLocks {
    /// The nftables tables of the `inet` family there are, by name.
    pub tables: Mutex<HashSet<String>>,
    /// Every iptables command stasisd tried to run: its program and arguments.
    pub iptables: Mutex<Vec<Vec<String>>>,
}

#[async_trait]
impl NetworkLocks for FakeHost {
    fn delete_inet_table(&self, name: &str) -> io::Result<bool> {
        self.check("delete_inet_table")?;
        Ok(self.locks.tables.lock().unwrap().remove(name))
    }

    /// Each command succeeds, unless `run_iptables` fails.
    async fn run_iptables(&self, _reaper: &Reaper, cmd: Command) -> io::Result<(ExitKind, String)> {
        let argv = std::iter::once(cmd.get_program()).chain(cmd.get_args());
        self.locks.iptables.lock().unwrap().push(argv.map(|a| a.to_string_lossy().into_owned()).collect());
        self.check("run_iptables")?;
        Ok((ExitKind::Exited(0), String::new()))
    }
}
