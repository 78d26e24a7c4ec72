//! Restoring a container's checkpoint (one imported from Podman's archive) through the
//! container runtime: the process tree lives in the container's namespaces, mounts and
//! rootfs, which only the runtime builds. stasis writes the archive back and has Podman
//! restore it; Podman manages the restored container from then on.

use std::path::Path;
use std::process::Command;
use std::time::Instant;

use tracing::info;

use super::Compression;
use crate::engine::ids::ms;
use crate::engine::restore::{RestoreOutcome, RestoreStats};
use crate::engine::workloads::valid_name;
use crate::engine::{Engine, RestoreError};
use crate::linux::reaper::ExitKind;
use crate::store::Manifest;

impl Engine {
    /// Restores `manifest`, a container engine's checkpoint, as container `name`.
    pub(in crate::engine) async fn restore_container(
        &self,
        manifest: &Manifest,
        name: &str,
    ) -> Result<RestoreOutcome, RestoreError> {
        let started = Instant::now();
        let id = manifest.id.clone();
        if !valid_name(name) || name.starts_with('-') {
            return Err(RestoreError::BadName { name: name.into(), why: "it is not a valid container name" });
        }
        let engine = manifest.archive.as_ref().map(|a| a.engine.as_str()).unwrap_or_default();
        let podman = self.deps.host.find_program("podman").filter(|_| engine == "podman");
        let Some(podman) = podman else {
            return Err(RestoreError::Incompatible { id, reason: self.restorable(engine) });
        };
        let work = self
            .deps
            .state
            .new_work_dir(&format!("container-{id}"))
            .map_err(RestoreError::local("work directory"))?;
        let archive = work.path().join("checkpoint.tar");
        let runtime = |why: String| RestoreError::Runtime { id: id.clone(), runtime: "podman", why };
        self.write_archive(manifest, &archive, Compression::None)
            .await
            .map_err(|e| runtime(crate::error_chain(&e)))?;
        let archive_arg = archive.display().to_string();
        let args = ["container", "restore", "--import", &archive_arg, "--name", name].map(str::to_owned);
        let restored = self.run_podman(&podman, &args).await;
        let _ = std::fs::remove_dir_all(work.path());
        let container = restored.map_err(&runtime)?;
        let format = ["inspect", "--format", "{{.State.Pid}}", &container].map(str::to_owned);
        let pid = self.run_podman(&podman, &format).await.map_err(&runtime)?;
        let pid = pid.parse().map_err(|_| runtime(format!("podman inspect gave {pid:?} for a pid")))?;
        let first_run_ms = ms(started.elapsed());
        info!(checkpoint = %id, container = %container, pid, "restored by podman");
        Ok(RestoreOutcome {
            id,
            workload: name.into(),
            pid,
            stats: RestoreStats {
                restore_ms: first_run_ms,
                first_run_ms,
                resident_ms: first_run_ms,
                ..Default::default()
            },
            warnings: vec![format!(
                "restored by podman as container {} ({name}): podman manages it from now on",
                &container[..container.len().min(12)]
            )],
        })
    }
}

impl Engine {
    /// Runs `podman args`; the last line of its output, or why it failed.
    async fn run_podman(&self, podman: &Path, args: &[String]) -> Result<String, String> {
        let mut cmd = Command::new(podman);
        cmd.args(args);
        match self.deps.reaper.run_output(cmd).await {
            Ok((ExitKind::Exited(0), stdout, _)) => {
                Ok(stdout.lines().last().unwrap_or_default().trim().to_owned())
            }
            Ok((exit, _, stderr)) => {
                let tail: Vec<&str> = stderr.lines().rev().take(3).collect();
                let said = tail.into_iter().rev().collect::<Vec<_>>().join(" / ");
                Err(format!("`podman {}` ended with {exit:?}: {said}", args[..2].join(" ")))
            }
            Err(e) => Err(format!("cannot run {}: {e}", podman.display())),
        }
    }
}
