//! `stasis import`: a container checkpoint archive taken in as a checkpoint of the store. Its
//! memory (CRIU's pagemap and pages images) is staged as a dump's pages are and chunked like
//! them, so it deduplicates against every other checkpoint; CRIU's other images are file
//! images; the archive's files outside `checkpoint/` are kept as they were, for an export.

use std::collections::BTreeSet;
use std::fs::File;
use std::io::{self, Read};
use std::path::Path;
use std::sync::Arc;

use prost::Message;
use stasis_proto::stasis::store::v1::ArchiveInfo;
use tracing::info;

use super::layout::{
    CONFIG_DUMP, ConfigDump, IMAGES_DIR, SPEC_DUMP, STASIS_MANIFEST, STATS_DUMP, SpecDump, engine_of,
    kept_name, open_archive, safe_entry_path,
};
use super::{ArchiveError, ImportOutcome};
use crate::criu::images::{pagemap_dst_id, pages_file_name, read_pagemap, read_pstree};
use crate::engine::ids::{checkpoint_id, now_unix_ms};
use crate::engine::workloads::valid_name;
use crate::engine::{Caller, Engine};
use crate::pages::{PE_PARENT, PageSink};
use crate::store::{DumpPages, Manifest, Staged, Staging};

/// What was unpacked: the archive's paths outside `checkpoint/` (files and directories) and
/// what its JSON files say.
struct Unpacked {
    paths: Vec<String>,
    dirs: Vec<String>,
    config: ConfigDump,
    spec: SpecDump,
    stasis: Option<Manifest>,
}

/// What the workload name of an import starts with when it is not given.
const IMPORTED: &str = "imported.";

impl Engine {
    /// Takes in the archive at `path` as a checkpoint of workload `workload` (or the one the
    /// archive names).
    pub async fn import(
        &self,
        path: &Path,
        workload: Option<&str>,
        caller: Caller,
    ) -> Result<ImportOutcome, ArchiveError> {
        if caller != Caller::Root {
            return Err(ArchiveError::RootOnly);
        }
        if !path.is_absolute() || !path.is_file() {
            let why = if path.is_absolute() { "it is not a file" } else { "it is not absolute" };
            return Err(ArchiveError::BadPath { path: path.to_path_buf(), why: why.into() });
        }
        let id = checkpoint_id(now_unix_ms());
        let work = self
            .deps
            .state
            .new_work_dir(&format!("import-{id}"))
            .map_err(ArchiveError::local("work directory"))?;
        let (dir, archive, spill) = (work.path().join("x"), path.to_path_buf(), work.path().join("spill"));
        let staging = Staging::new(&self.shared.staging, &spill);
        let unpacked = tokio::task::spawn_blocking(move || {
            let unpacked = unpack(&archive, &dir)?;
            let staged = stage_memory(&dir.join(IMAGES_DIR), staging)?;
            Ok::<_, ArchiveError>((unpacked, staged, dir))
        })
        .await
        .map_err(|e| ArchiveError::local("archive reader")(io::Error::other(e)));
        let result = match unpacked.and_then(|r| r) {
            Ok((unpacked, staged, dir)) => {
                self.store_import(&id, path, workload, unpacked, staged, &dir).await
            }
            Err(e) => Err(e),
        };
        let _ = std::fs::remove_dir_all(work.path());
        result
    }

    async fn store_import(
        &self,
        id: &str,
        path: &Path,
        workload: Option<&str>,
        unpacked: Unpacked,
        staged: Staged,
        dir: &Path,
    ) -> Result<ImportOutcome, ArchiveError> {
        let images = dir.join(IMAGES_DIR);
        let pstree =
            std::fs::read(images.join("pstree.img")).map_err(ArchiveError::local("checkpoint/pstree.img"))?;
        let pids = read_pstree(&pstree).map_err(|e| ArchiveError::malformed(e.to_string()))?;
        let engine = engine_of(&unpacked.spec, unpacked.stasis.is_some());
        // A name of its own unless told otherwise: under the archive's name, an import would
        // become the newest checkpoint of a workload of that name (a running one, say), and
        // that workload's retention would then delete its real checkpoints in its favour.
        let name = match workload {
            Some(name) => name.to_owned(),
            None => unpacked
                .stasis
                .as_ref()
                .map(|m| m.workload.as_str())
                .or(Some(unpacked.config.name.as_str()).filter(|n| !n.is_empty()))
                .map_or_else(|| format!("imported-{}", &id[id.len() - 6..]), |n| format!("{IMPORTED}{n}")),
        };
        if !valid_name(&name) {
            return Err(ArchiveError::BadWorkload(name));
        }
        let kept = keep_files(dir, &unpacked)?;
        let guard = self.deps.store.begin_commit().await?;
        let quiet: crate::store::Progress = Arc::new(|_, _| {});
        let stored =
            self.deps.store.store_dump(DumpPages::Staged(Arc::new(staged)), &images, &[], quiet).await?;
        let mut manifest = match unpacked.stasis {
            Some(own) => own,
            None => Manifest {
                root_pid: pids.first().map_or(0, |p| p.0 as i32),
                pids: pids.iter().map(|p| p.0 as i32).collect(),
                command: unpacked.spec.process.args.clone(),
                node: self.deps.host.node_name(),
                archive: Some(ArchiveInfo {
                    engine: engine.into(),
                    paths: unpacked.paths.clone(),
                    dirs: unpacked.dirs.clone(),
                    container: unpacked.config.name.clone(),
                    image: unpacked.config.rootfs_image_name.clone(),
                }),
                ..Default::default()
            },
        };
        manifest.id = id.into();
        manifest.workload = name.clone();
        // Whatever the archive claims, an import is its importer's: imports are root's alone.
        manifest.owner_uid = Caller::Root.uid();
        manifest.created_unix_ms = now_unix_ms();
        manifest.parent_id.clear();
        manifest.files = stored.files;
        manifest.memory = stored.memory;
        manifest.stats = Some(crate::engine::CheckpointStats {
            bytes_total: stored.chunks.bytes_total,
            bytes_uploaded: stored.bytes_uploaded,
            chunks_total: stored.chunks.chunks_total,
            chunks_new: stored.chunks.chunks_new,
            ..Default::default()
        });
        self.deps.store.commit(&manifest, &guard).await?;
        info!(checkpoint = %id, workload = %name, engine, archive = %path.display(), "archive imported");
        Ok(ImportOutcome {
            id: id.into(),
            workload: name,
            engine: engine.into(),
            kept,
            bytes_total: stored.chunks.bytes_total,
            bytes_uploaded: stored.bytes_uploaded,
            restore: self.restorable(engine),
        })
    }

    /// How a checkpoint from an archive of `engine` can be restored on this node.
    pub(super) fn restorable(&self, engine: &str) -> String {
        match engine {
            "stasis" => "stasis restore, as any checkpoint".into(),
            "podman" if self.deps.host.find_program("podman").is_some() => {
                "stasis restore hands it to podman (`podman container restore --import`)".into()
            }
            other => format!(
                "not here: a container of {other} is restored by its runtime, which stasis cannot drive \
                 on this node; `stasis export` gives the archive back for it"
            ),
        }
    }
}

/// The bytes that may still be written to the file system of `dir` (less what it keeps for root).
fn free_bytes(dir: &Path) -> Option<u64> {
    let stat = nix::sys::statvfs::statvfs(dir).ok()?;
    Some(stat.blocks_available().saturating_mul(stat.fragment_size()))
}

/// Unpacks the archive at `archive` into `dir`: only regular files and directories at safe
/// relative paths, CRIU's images flat in `checkpoint/`.
fn unpack(archive: &Path, dir: &Path) -> Result<Unpacked, ArchiveError> {
    let malformed = ArchiveError::malformed;
    let mut tar = open_archive(archive).map_err(|e| malformed(format!("cannot read it: {e}")))?;
    let (mut paths, mut dirs, mut has_images) = (Vec::new(), Vec::new(), false);
    // A small compressed archive can unpack to any size: what it may take is what the file
    // system of the work directory has free, counted from the entries' sizes as they come.
    let room_in = dir.parent().unwrap_or(dir);
    let room = free_bytes(room_in).unwrap_or(u64::MAX);
    let mut unpacked_bytes = 0u64;
    let entries = tar.entries().map_err(|e| malformed(format!("cannot read it: {e}")))?;
    for entry in entries {
        let mut entry = entry.map_err(|e| malformed(format!("a damaged entry: {e}")))?;
        let raw = entry.path().map_err(|e| malformed(format!("an unreadable path: {e}")))?.into_owned();
        // The archive's own top directory (`tar -C dir -cf x.tar .` writes `./`).
        if raw.components().all(|c| c == std::path::Component::CurDir) {
            continue;
        }
        if entry.header().entry_type() == tar::EntryType::Regular {
            unpacked_bytes = unpacked_bytes.saturating_add(entry.header().size().unwrap_or(u64::MAX));
            if unpacked_bytes > room {
                return Err(ArchiveError::TooBig { dir: room_in.to_path_buf(), free: room });
            }
        }
        let path =
            safe_entry_path(&raw).ok_or_else(|| malformed(format!("an unsafe path {:?}", raw.display())))?;
        let kind = entry.header().entry_type();
        let in_images = path.strip_prefix(&format!("{IMAGES_DIR}/"));
        match (kind, in_images) {
            (tar::EntryType::Directory, _) if path == IMAGES_DIR => has_images = true,
            (tar::EntryType::Directory, Some(_)) => {
                return Err(malformed(format!("a directory {path} among CRIU's images")));
            }
            (tar::EntryType::Directory, None) => dirs.push(path.clone()),
            (tar::EntryType::Regular, _) => {}
            (other, _) => return Err(malformed(format!("{path} is a {other:?}, not a file or directory"))),
        }
        let target = dir.join(&path);
        if kind == tar::EntryType::Regular {
            if let Some(parent) = target.parent() {
                std::fs::create_dir_all(parent).map_err(ArchiveError::local("the unpacked archive"))?;
            }
            let mut out = File::create(&target).map_err(ArchiveError::local("the unpacked archive"))?;
            io::copy(&mut entry, &mut out).map_err(|e| malformed(format!("{path} is cut short: {e}")))?;
            has_images |= in_images.is_some();
        } else {
            std::fs::create_dir_all(&target).map_err(ArchiveError::local("the unpacked archive"))?;
        }
        if in_images.is_none() && path != IMAGES_DIR {
            paths.push(path);
        }
    }
    if !has_images {
        return Err(malformed(format!("no {IMAGES_DIR}/ directory: it is not a checkpoint archive")));
    }
    let json = |name: &str| -> Result<Option<Vec<u8>>, ArchiveError> {
        match std::fs::read(dir.join(name)) {
            Ok(data) => Ok(Some(data)),
            Err(e) if e.kind() == io::ErrorKind::NotFound => Ok(None),
            Err(e) => Err(ArchiveError::local("the unpacked archive")(e)),
        }
    };
    let parse = |name: &str| -> Result<Option<serde_json::Value>, ArchiveError> {
        json(name)?
            .map(|d| serde_json::from_slice(&d))
            .transpose()
            .map_err(|e| malformed(format!("{name}: {e}")))
    };
    let config = parse(CONFIG_DUMP)?.map(serde_json::from_value).transpose();
    let spec = parse(SPEC_DUMP)?.map(serde_json::from_value).transpose();
    let stasis = json(STASIS_MANIFEST)?
        .map(|d| Manifest::decode(d.as_slice()))
        .transpose()
        .map_err(|e| malformed(format!("{STASIS_MANIFEST}: {e}")))?;
    paths.retain(|p| p != STASIS_MANIFEST);
    Ok(Unpacked {
        paths,
        dirs,
        config: config.map_err(|e| malformed(format!("{CONFIG_DUMP}: {e}")))?.unwrap_or_default(),
        spec: spec.map_err(|e| malformed(format!("{SPEC_DUMP}: {e}")))?.unwrap_or_default(),
        stasis,
    })
}

/// Feeds the memory of CRIU's pagemap and pages images in `images` to `staging`, as a dump
/// would, and removes those images.
fn stage_memory(images: &Path, mut staging: Staging) -> Result<Staged, ArchiveError> {
    let malformed = ArchiveError::malformed;
    let local = ArchiveError::local("the unpacked archive");
    let mut pagemaps: Vec<(String, u64)> = std::fs::read_dir(images)
        .map_err(&local)?
        .flatten()
        .filter_map(|e| e.file_name().into_string().ok())
        .filter_map(|name| Some((name.clone(), pagemap_dst_id(&name)?)))
        .collect();
    pagemaps.sort();
    let mut used_pages = BTreeSet::new();
    for (name, dst_id) in pagemaps {
        let data = std::fs::read(images.join(&name)).map_err(&local)?;
        let (pages_id, runs) = read_pagemap(&data, dst_id).map_err(|e| malformed(format!("{name}: {e}")))?;
        if runs.iter().any(|r| r.flags & PE_PARENT != 0) {
            return Err(malformed(format!(
                "{name} refers to pages of a parent dump (a pre-checkpoint) that the archive does not hold"
            )));
        }
        // An empty pagemap (a shared mapping never written) is kept: CRIU's restore wants it.
        staging.open(dst_id).map_err(&local)?;
        let pages_name = pages_file_name(pages_id);
        let mut pages = io::BufReader::new(File::open(images.join(&pages_name)).map_err(&local)?);
        for run in runs {
            staging.run(run, &mut pages).map_err(|e| malformed(format!("{pages_name} is cut short: {e}")))?;
        }
        if pages.read(&mut [0u8]).map_err(&local)? != 0 {
            return Err(malformed(format!("{pages_name} holds more than {name} maps")));
        }
        used_pages.insert(pages_name);
        std::fs::remove_file(images.join(&name)).map_err(&local)?;
    }
    for pages in used_pages {
        std::fs::remove_file(images.join(pages)).map_err(&local)?;
    }
    staging.finish().map_err(local)
}

/// Moves the archive's files outside `checkpoint/` into the images directory under the names
/// that keep them (`stats-dump` under CRIU's own); returns the archive's paths taken in.
fn keep_files(dir: &Path, unpacked: &Unpacked) -> Result<Vec<String>, ArchiveError> {
    let images = dir.join(IMAGES_DIR);
    let local = ArchiveError::local("the unpacked archive");
    let mut kept: Vec<String> = std::fs::read_dir(&images)
        .map_err(&local)?
        .flatten()
        .filter_map(|e| Some(format!("{IMAGES_DIR}/{}", e.file_name().into_string().ok()?)))
        .collect();
    kept.sort();
    // A checkpoint of stasis gets its config.dump and spec.dump made anew by an export.
    let own = unpacked.stasis.is_some();
    let files = unpacked.paths.iter().filter(|p| !unpacked.dirs.contains(p));
    for path in files.filter(|p| !own || *p == STATS_DUMP) {
        let name = match path.as_str() {
            STATS_DUMP => STATS_DUMP.to_string(),
            _ => {
                kept_name(path).ok_or_else(|| ArchiveError::malformed(format!("a ':' in the path {path}")))?
            }
        };
        std::fs::rename(dir.join(path), images.join(name)).map_err(&local)?;
        kept.push(path.clone());
    }
    Ok(kept)
}
