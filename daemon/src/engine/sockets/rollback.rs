//! Giving a tree CRIU dumped and left stopped its connections back, when it is resumed
//! instead of killed (storing its checkpoint failed).
//!
//! CRIU leaves every dumped TCP connection in repair mode (the socket neither sends nor
//! answers) and locked (its packets dropped by CRIU's nftables table or iptables rules), so
//! that a restore can take it over. A resumed tree would find its connections silently dead.
//! The host takes them out of repair mode (`Host::leave_repair`, which lists the tree's
//! sockets again rather than taking them from the survey: a connection opened between the
//! survey and the freeze is in repair mode too); the lock is removed here, through the host's
//! [`NetworkLocks`].

use std::net::SocketAddr;
use std::path::Path;
use std::sync::Arc;

use tracing::{debug, info};

use super::super::host::{Host, NetworkLocks};
use crate::criu::NetworkLock;
use crate::criu::images::dump_run_id;
use crate::linux::iptables::unlock_commands;
use crate::linux::reaper::{ExitKind, Reaper};

/// Length of the lock table's name as CRIU 4.2 writes it: "inet CRIU-<run id>" cut to fit a
/// 32-byte buffer, less the family.
const CUT_TABLE_NAME: usize = 31 - "inet ".len();

/// A connection's local and remote ends.
pub type Connection = (SocketAddr, SocketAddr);

/// Removes CRIU's `lock` of the `reopened` connections of the dump in `images_dir`, on
/// `host` (iptables commands run through `reaper`). Returns what could not be undone.
pub async fn unlock(
    host: &Arc<dyn Host>,
    reaper: &Reaper,
    reopened: &[Connection],
    images_dir: &Path,
    lock: Option<NetworkLock>,
) -> Vec<String> {
    if reopened.is_empty() {
        return Vec::new();
    }
    match lock {
        Some(NetworkLock::Nftables) => {
            let (host, images) = (host.clone(), images_dir.to_path_buf());
            let unlocked = tokio::task::spawn_blocking(move || unlock_nftables(host.as_ref(), &images)).await;
            unlocked
                .unwrap_or_else(|e| Some(format!("removing CRIU's nftables lock failed: {e}")))
                .into_iter()
                .collect()
        }
        Some(NetworkLock::Iptables) => {
            let mut problems = Vec::new();
            for &(local, remote) in reopened {
                for cmd in unlock_commands(local, remote) {
                    let program = cmd.get_program().to_string_lossy().into_owned();
                    match host.run_iptables(reaper, cmd).await {
                        Ok((ExitKind::Exited(0), _)) => {}
                        Ok((exit, stderr)) => problems.push(format!(
                            "connection {local} -> {remote} stays locked: {program} ended with {exit}: {}",
                            stderr.trim()
                        )),
                        Err(e) => problems.push(format!(
                            "connection {local} -> {remote} stays locked: cannot run {program}: {e}"
                        )),
                    }
                }
            }
            problems
        }
        None => Vec::new(),
    }
}

/// Deletes the table CRIU locked the dump's connections in. CRIU names it "CRIU-" and its
/// run id, cut short by CRIU 4.2 and whole by later versions: both names are tried.
fn unlock_nftables(host: &dyn NetworkLocks, images_dir: &Path) -> Option<String> {
    let run_id = match dump_run_id(images_dir) {
        Ok(Some(id)) => id,
        Ok(None) => return Some("the dump records no CRIU run id, so its nftables lock stays".into()),
        Err(e) => return Some(format!("cannot read the dump's run id ({e}), so its nftables lock stays")),
    };
    match remove_lock_table(host, &run_id) {
        Ok(true) => None,
        Ok(false) => Some(format!("no nftables lock table of CRIU run {run_id} was found")),
        Err(why) => Some(format!("CRIU's nftables lock could not be removed ({why})")),
    }
}

/// Deletes, on `host`, the nftables table CRIU run `run_id` locked connections in: `Ok(true)`
/// if it was there, `Ok(false)` if not, `Err(why)` if it could not be deleted.
pub(super) fn remove_lock_table(host: &dyn NetworkLocks, run_id: &str) -> Result<bool, String> {
    let whole = format!("CRIU-{run_id}");
    let cut: String = whole.chars().take(CUT_TABLE_NAME).collect();
    let mut failures = Vec::new();
    for name in [cut, whole] {
        match host.delete_inet_table(&name) {
            Ok(true) => {
                info!(table = %name, "removed CRIU's network lock");
                return Ok(true);
            }
            Ok(false) => debug!(table = %name, "no such nftables table"),
            Err(e) => failures.push(format!("{name}: {e}")),
        }
    }
    match failures.is_empty() {
        true => Ok(false),
        false => Err(failures.join("; ")),
    }
}
