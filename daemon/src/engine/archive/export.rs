//! `stasis export`: a checkpoint written as a container checkpoint archive. CRIU's images are
//! rebuilt from the store into `checkpoint/` (memory as CRIU's pagemap and pages images, so
//! `criu restore -D` takes the unpacked directory as it is); an imported archive gets its own
//! other files back, a checkpoint of stasis gets a `config.dump` and `spec.dump` describing it
//! and its manifest, for a faithful import.

use std::path::Path;
use std::sync::Arc;

use prost::Message;
use tracing::info;

use super::layout::{
    ArchiveWriter, CONFIG_DUMP, Compression, ConfigDump, IMAGES_DIR, SPEC_DUMP, STASIS_MANIFEST, STATS_DUMP,
    SpecDump, SpecProcess, kept_name, kept_path,
};
use super::{ArchiveError, ExportOutcome};
use crate::engine::ids::valid_checkpoint_id;
use crate::engine::{Caller, Engine};
use crate::store::{Manifest, MemoryMode};

impl Engine {
    /// Writes checkpoint `id` to a new archive at `path`.
    pub async fn export(
        &self,
        id: &str,
        path: &Path,
        compression: Compression,
        caller: Caller,
    ) -> Result<ExportOutcome, ArchiveError> {
        if caller != Caller::Root {
            return Err(ArchiveError::RootOnly);
        }
        if !valid_checkpoint_id(id) {
            return Err(ArchiveError::BadId(id.into()));
        }
        check_new_path(path)?;
        let manifest = self.deps.store.manifest(id).await?;
        let files = self.write_archive(&manifest, path, compression).await?;
        let bytes = std::fs::metadata(path).map(|m| m.len()).unwrap_or_default();
        info!(checkpoint = %id, path = %path.display(), bytes, "checkpoint exported");
        Ok(ExportOutcome { id: id.into(), path: path.to_path_buf(), bytes, files })
    }

    /// Writes the archive of `manifest` to `path` (removed again on failure); returns its
    /// entries.
    pub(in crate::engine) async fn write_archive(
        &self,
        manifest: &Manifest,
        path: &Path,
        compression: Compression,
    ) -> Result<Vec<String>, ArchiveError> {
        let dir = format!("export-{}", manifest.id);
        let work = self.deps.state.new_work_dir(&dir).map_err(ArchiveError::local("work directory"))?;
        let images = work.path().to_path_buf();
        let quiet: crate::store::Progress = Arc::new(|_, _| {});
        let materialized = self.deps.store.materialize_as(manifest, &images, MemoryMode::Eager, quiet).await;
        let files = match materialized {
            Ok(_) => {
                let (out, written) = (path.to_path_buf(), manifest.clone());
                tokio::task::spawn_blocking(move || archive_of(&out, compression, &written, &images))
                    .await
                    .map_err(|e| ArchiveError::local("archive writer")(std::io::Error::other(e)))
                    .and_then(|r| r)
            }
            Err(e) => Err(e.into()),
        };
        let _ = std::fs::remove_dir_all(work.path());
        files.inspect_err(|_| {
            let _ = std::fs::remove_file(path);
        })
    }
}

/// Refuses a relative path, one that exists, or one whose directory does not.
fn check_new_path(path: &Path) -> Result<(), ArchiveError> {
    let bad = |why: &str| Err(ArchiveError::BadPath { path: path.to_path_buf(), why: why.into() });
    if !path.is_absolute() {
        return bad("it is not absolute");
    }
    if path.symlink_metadata().is_ok() {
        return bad("it exists already");
    }
    match path.parent() {
        Some(dir) if dir.is_dir() => Ok(()),
        _ => bad("its directory does not exist"),
    }
}

/// Writes the archive of `manifest` whose images are in `images`; returns its entries.
fn archive_of(
    path: &Path,
    compression: Compression,
    manifest: &Manifest,
    images: &Path,
) -> Result<Vec<String>, ArchiveError> {
    let failed = ArchiveError::local("the archive");
    let mut names: Vec<String> = std::fs::read_dir(images)
        .map_err(&failed)?
        .flatten()
        .filter_map(|e| e.file_name().into_string().ok())
        .collect();
    names.sort();
    let mut tar = ArchiveWriter::create(path, compression).map_err(&failed)?;
    tar.dir(IMAGES_DIR).map_err(&failed)?;
    for name in names.iter().filter(|n| kept_path(n).is_none() && *n != STATS_DUMP) {
        tar.copy(&format!("{IMAGES_DIR}/{name}"), &images.join(name)).map_err(&failed)?;
    }
    if names.iter().any(|n| n == STATS_DUMP) {
        tar.copy(STATS_DUMP, &images.join(STATS_DUMP)).map_err(&failed)?;
    }
    match &manifest.archive {
        // An imported archive's own files, as they were.
        Some(archive) => {
            for entry in &archive.paths {
                let kept = kept_name(entry).filter(|name| names.contains(name));
                match (archive.dirs.contains(entry), kept) {
                    (true, _) => tar.dir(entry),
                    (false, Some(name)) => tar.copy(entry, &images.join(name)),
                    (false, None) => Ok(()),
                }
                .map_err(&failed)?;
            }
        }
        None => {
            let (config, spec) = dumps_of(manifest);
            tar.file(CONFIG_DUMP, &config).map_err(&failed)?;
            tar.file(SPEC_DUMP, &spec).map_err(&failed)?;
            let mut own = manifest.clone();
            own.files.clear();
            own.memory.clear();
            tar.file(STASIS_MANIFEST, &own.encode_to_vec()).map_err(&failed)?;
        }
    }
    tar.finish().map_err(failed)
}

/// `config.dump` and `spec.dump` describing a checkpoint of stasis.
fn dumps_of(manifest: &Manifest) -> (Vec<u8>, Vec<u8>) {
    let time = jiff::Timestamp::from_millisecond(manifest.created_unix_ms as i64).map(|t| t.to_string()).ok();
    let config = ConfigDump {
        id: manifest.id.clone(),
        name: manifest.workload.clone(),
        rootfs_image_name: String::new(),
        runtime: "stasis".into(),
        created_time: time.clone(),
        checkpointed_time: time,
    };
    let annotations = [
        ("io.container.manager", "stasis".to_string()),
        ("org.criu.checkpoint.container.name", manifest.workload.clone()),
        ("io.kubernetes.cri.container-name", manifest.workload.clone()),
        ("org.criu.checkpoint.criu-version", manifest.criu_version.clone()),
        ("org.criu.checkpoint.host.kernel", manifest.kernel.clone()),
    ];
    let spec = SpecDump {
        oci_version: "1.0.2".into(),
        process: SpecProcess { args: manifest.command.clone(), cwd: "/".into() },
        annotations: annotations.into_iter().map(|(k, v)| (k.to_string(), v)).collect(),
    };
    (
        serde_json::to_vec_pretty(&config).unwrap_or_default(),
        serde_json::to_vec_pretty(&spec).unwrap_or_default(),
    )
}
