//! The peer pipeline, what a user scripts today: `criu dump` into a tmpfs directory, then
//! `tar | zstd -1 -T0` into the store; restore is the reverse, then `criu restore`.

use std::fs::File;
use std::path::{Path, PathBuf};
use std::process::Command;
use std::time::{Duration, Instant};

use anyhow::{Context, bail};

use crate::daemon::{Daemon, settle};

/// Runs a bash pipeline (with pipefail: a failing `tar` fails it), failing with its stderr.
fn sh(script: &str) -> anyhow::Result<()> {
    let out = Command::new("bash").args(["-o", "pipefail", "-c", script]).output().context("running bash")?;
    if !out.status.success() {
        bail!("`{script}` failed ({}): {}", out.status, String::from_utf8_lossy(&out.stderr));
    }
    Ok(())
}

/// The last lines of a CRIU log (the scratch directory holding it is removed on exit).
fn log_tail(log: &Path) -> String {
    let text = std::fs::read_to_string(log).unwrap_or_default();
    let lines: Vec<&str> = text.lines().collect();
    lines[lines.len().saturating_sub(20)..].join("\n")
}

/// Timings (from the start of `criu dump`) and size of one peer checkpoint.
pub struct PeerCheckpoint {
    /// `criu dump` to tmpfs, start to exit: the tree is frozen within it.
    pub dump: Duration,
    /// The tarball written into the store directory (in the page cache, as stasis's
    /// `file://` store writes its packs).
    pub written: Duration,
    /// `written`, then fsync of the tarball and its directory.
    pub fsynced: Duration,
    pub bytes: u64,
    pub tarball: PathBuf,
}

/// Timings of one peer restore.
pub struct PeerRestore {
    /// `zstd -d | tar -x` into tmpfs.
    pub unpack: Duration,
    /// Unpack, then `criu restore -d`.
    pub total: Duration,
}

pub struct Peer {
    pub criu: PathBuf,
    /// A tmpfs directory for image directories.
    pub scratch: PathBuf,
    /// Where tarballs are "uploaded": a directory beside the stasis store, same file system.
    pub store: PathBuf,
}

impl Peer {
    /// The peer of `d`'s run: image directories in its scratch directory, tarballs in a
    /// directory of its store's (on the same file system, dropped from the page cache with it).
    pub fn beside(d: &Daemon, criu: PathBuf) -> Peer {
        Peer { criu, scratch: d.scratch.clone(), store: d.work.join("store").join("peer") }
    }

    /// Dumps `pid` (left running) into tmpfs, then stores the tarball `<name>.tar.zst`.
    pub fn checkpoint(&self, pid: i32, name: &str) -> anyhow::Result<PeerCheckpoint> {
        let dir = self.scratch.join(name);
        std::fs::create_dir_all(&dir)?;
        std::fs::create_dir_all(&self.store)?;
        let tarball = self.store.join(format!("{name}.tar.zst"));
        settle();
        let started = Instant::now();
        let criu = self.criu.display();
        sh(&format!("{criu} dump -t {pid} -D {} --leave-running -o dump.log", dir.display()))
            .with_context(|| format!("peer dump; end of dump.log:\n{}", log_tail(&dir.join("dump.log"))))?;
        let dump = started.elapsed();
        sh(&format!(
            "tar -C {dir} -cf - . | zstd -q -f -1 -T0 -o {tar}",
            dir = dir.display(),
            tar = tarball.display()
        ))?;
        let written = started.elapsed();
        File::open(&tarball)?.sync_all().context("fsync of the tarball")?;
        File::open(&self.store)?.sync_all().context("fsync of the tarball's directory")?;
        let fsynced = started.elapsed();
        std::fs::remove_dir_all(&dir)?;
        let bytes = std::fs::metadata(&tarball)?.len();
        Ok(PeerCheckpoint { dump, written, fsynced, bytes, tarball })
    }

    /// Reads back, unpacks into tmpfs and restores a tarball (detached).
    pub fn restore(&self, tarball: &Path) -> anyhow::Result<PeerRestore> {
        let dir = self.scratch.join("restore");
        let _ = std::fs::remove_dir_all(&dir);
        std::fs::create_dir_all(&dir)?;
        settle();
        let started = Instant::now();
        sh(&format!("zstd -q -d -c {} | tar -C {} -xf -", tarball.display(), dir.display()))?;
        let unpack = started.elapsed();
        sh(&format!("{} restore -D {} -d -o restore.log", self.criu.display(), dir.display())).with_context(
            || format!("peer restore; end of restore.log:\n{}", log_tail(&dir.join("restore.log"))),
        )?;
        let total = started.elapsed();
        std::fs::remove_dir_all(&dir)?;
        Ok(PeerRestore { unpack, total })
    }
}
