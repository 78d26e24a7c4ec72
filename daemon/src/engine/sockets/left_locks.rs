//! The network locks evictions leave on this node.
//!
//! CRIU keeps an evicted tree's connections locked (an nftables table of its own, hooked into
//! the path of every packet of the node) so that a restore here can take them over; such a
//! restore removes it. When none comes (the job was restored on another node, or never), the
//! table would stay for good, and every packet would pass one more table per eviction. So
//! stasisd records each lock it leaves, and removes those older than `network_lock_keep_secs`
//! (30 minutes by default): by then the peers have given up on those connections (Linux stops
//! retransmitting after about 15 minutes), so a restore could not resume them anyway.

use std::fs;
use std::io;
use std::path::{Path, PathBuf};
use std::sync::Arc;
use std::time::{Duration, SystemTime};

use tracing::{info, warn};

use super::super::host::Host;
use super::rollback::remove_lock_table;
use crate::criu::images::dump_run_id;

/// How often the records are looked at.
pub const SWEEP_EVERY: Duration = Duration::from_secs(60);

/// The records, one empty file per lock, named after the CRIU run that left it; and the host
/// whose locks they are.
#[derive(Clone)]
pub struct LeftLocks {
    dir: PathBuf,
    host: Arc<dyn Host>,
}

impl LeftLocks {
    /// The records in `dir` (the state directory's `netlocks/`) of the locks left on `host`.
    pub fn at(dir: PathBuf, host: Arc<dyn Host>) -> LeftLocks {
        LeftLocks { dir, host }
    }

    /// Records the lock the dump in `images_dir` left.
    pub fn record(&self, images_dir: &Path) -> io::Result<()> {
        let Some(run_id) = dump_run_id(images_dir)? else { return Ok(()) };
        fs::write(self.dir.join(run_id), b"")
    }

    /// Removes the locks recorded more than `keep` ago (or already gone); returns the run
    /// ids whose lock is gone now. A lock that cannot be removed stays recorded.
    pub fn sweep(&self, keep: Duration) -> Vec<String> {
        let Ok(entries) = fs::read_dir(&self.dir) else { return Vec::new() };
        let now = SystemTime::now();
        let mut removed = Vec::new();
        for entry in entries.flatten() {
            let age = entry
                .metadata()
                .and_then(|m| m.modified())
                .map(|t| now.duration_since(t).unwrap_or_default());
            let Ok(run_id) = entry.file_name().into_string() else { continue };
            if age.is_ok_and(|age| age < keep) {
                continue;
            }
            match remove_lock_table(self.host.as_ref(), &run_id) {
                Ok(_) => {
                    let _ = fs::remove_file(entry.path());
                    removed.push(run_id);
                }
                Err(why) => {
                    warn!(run_id = %run_id, reason = %why, "cannot remove an eviction's network lock")
                }
            }
        }
        if !removed.is_empty() {
            info!(locks = removed.len(), "removed network locks no restore took over");
        }
        removed
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::engine::host::LinuxHost;
    use crate::engine::host::fake::FakeHost;
    use crate::linux::nft;
    use stasis_criu_images::testing::write_inventory;

    #[test]
    fn a_lock_that_cannot_be_removed_stays_recorded_until_it_can() {
        let (state, images) = (tempfile::tempdir().unwrap(), tempfile::tempdir().unwrap());
        let run_id = "0badc0de-0000-4000-8000-000000000001";
        write_inventory(images.path(), run_id);
        let host = Arc::new(FakeHost::default());
        // The table as CRIU 4.2 names it: "CRIU-" and the run id, cut to 26 characters.
        let table: String = format!("CRIU-{run_id}").chars().take(26).collect();
        host.locks.tables.lock().unwrap().insert(table);
        host.fail("delete_inet_table");
        let locks = LeftLocks::at(state.path().to_path_buf(), host.clone());
        locks.record(images.path()).unwrap();

        assert!(locks.sweep(Duration::ZERO).is_empty(), "nothing could be removed");
        assert!(state.path().join(run_id).exists(), "the lock stays recorded");
        assert_eq!(host.locks.tables.lock().unwrap().len(), 1);

        host.failing.lock().unwrap().clear();
        assert_eq!(locks.sweep(Duration::ZERO), vec![run_id.to_string()]);
        assert!(host.locks.tables.lock().unwrap().is_empty(), "its table is deleted");
        assert!(!state.path().join(run_id).exists(), "and its record with it");
    }

    #[test]
    fn a_recorded_lock_goes_once_it_is_old_enough() {
        if !nix::unistd::geteuid().is_root() {
            eprintln!("skipping: only root may change nftables");
            return;
        }
        let (state, images) = (tempfile::tempdir().unwrap(), tempfile::tempdir().unwrap());
        let run_id =
            format!("{:08x}-0000-4000-8000-{:012x}", std::process::id(), rand::random::<u64>() >> 16);
        write_inventory(images.path(), &run_id);
        // The table as CRIU 4.2 names it: "CRIU-" and the run id, cut to 26 characters.
        let table: String = format!("CRIU-{run_id}").chars().take(26).collect();
        assert!(nft::create_inet_table(&table).unwrap());
        let locks = LeftLocks::at(state.path().to_path_buf(), Arc::new(LinuxHost));
        locks.record(images.path()).unwrap();

        assert!(locks.sweep(Duration::from_secs(3600)).is_empty(), "a young lock stays");
        assert_eq!(locks.sweep(Duration::ZERO), vec![run_id]);
        assert!(!nft::delete_inet_table(&table).unwrap(), "the table should be gone");
        assert!(locks.sweep(Duration::ZERO).is_empty(), "nothing left to sweep");
    }
}
