//! The peer pipeline, what a user scripts today: `criu dump` into a tmpfs directory, then
//! `tar | zstd -1 -T0` into the store; restore is the reverse and `criu restore`.

use std::path::{Path, PathBuf};
use std::process::Command;
use std::time::{Duration, Instant};

use anyhow::{Context, bail};

/// Runs a shell pipeline, failing with its stderr.
fn sh(script: &str) -> anyhow::Result<()> {
    let out = Command::new("sh").arg("-c").arg(script).output().context("running sh")?;
    if !out.status.success() {
        bail!("`{script}` failed: {}", String::from_utf8_lossy(&out.stderr));
    }
    Ok(())
}

/// Timings and size of one peer checkpoint.
pub struct PeerCheckpoint {
    pub dump: Duration,
    pub durable: Duration,
    pub bytes: u64,
    pub tarball: PathBuf,
}

pub struct Peer {
    pub criu: PathBuf,
    /// A tmpfs directory for image directories.
    pub scratch: PathBuf,
    /// Where tarballs are "uploaded": a directory of the same file system as the stasis store.
    pub store: PathBuf,
}

impl Peer {
    /// Dumps `pid` (left running) and stores the tarball `name`.
    pub fn checkpoint(&self, pid: i32, name: &str) -> anyhow::Result<PeerCheckpoint> {
        let dir = self.scratch.join(name);
        std::fs::create_dir_all(&dir)?;
        std::fs::create_dir_all(&self.store)?;
        let tarball = self.store.join(format!("{name}.tar.zst"));
        let started = Instant::now();
        let criu = self.criu.display();
        sh(&format!("{criu} dump -t {pid} -D {} --leave-running -o dump.log", dir.display()))?;
        let dump = started.elapsed();
        sh(&format!(
            "tar -C {dir} -cf - . | zstd -q -1 -T0 -o {tar} && sync -f {tar}",
            dir = dir.display(),
            tar = tarball.display()
        ))?;
        let durable = started.elapsed();
        std::fs::remove_dir_all(&dir)?;
        let bytes = std::fs::metadata(&tarball)?.len();
        Ok(PeerCheckpoint { dump, durable, bytes, tarball })
    }

    /// Fetches, unpacks and restores a tarball (detached); returns the time it took.
    pub fn restore(&self, tarball: &Path) -> anyhow::Result<Duration> {
        let dir = self.scratch.join("restore");
        let _ = std::fs::remove_dir_all(&dir);
        std::fs::create_dir_all(&dir)?;
        let started = Instant::now();
        sh(&format!("zstd -q -d -c {} | tar -C {} -xf -", tarball.display(), dir.display()))?;
        sh(&format!("{} restore -D {} -d -o restore.log", self.criu.display(), dir.display()))?;
        let took = started.elapsed();
        std::fs::remove_dir_all(&dir)?;
        Ok(took)
    }
}
