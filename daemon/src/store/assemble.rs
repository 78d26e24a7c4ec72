//! Rebuilding a CRIU image directory from a checkpoint: every chunk fetched (packs in
//! parallel, range reads coalesced by `object_store`), decompressed, checked against its hash,
//! and written in place; pagemaps rebuilt from the manifest.

use std::collections::HashMap;
use std::fs::File;
use std::os::unix::fs::FileExt;
use std::path::Path;
use std::sync::Arc;
use std::sync::atomic::{AtomicU64, Ordering};

use futures::{StreamExt, TryStreamExt};
use stasis_proto::stasis::v1::{ChunkRef, Codec};

use super::index::{ChunkHash, ChunkLoc};
use super::{Manifest, Progress, Store, StoreError};
use crate::criu::images::{pagemap_file_name, pages_file_name, write_pagemap};
use crate::criu::pageserver::PageRun;

/// Packs fetched at the same time.
const PACKS_IN_FLIGHT: usize = 8;

/// A chunk to fetch and where its bytes go.
struct Placement {
    loc: ChunkLoc,
    hash: ChunkHash,
    file: Arc<File>,
    offset: u64,
}

impl Store {
    /// Writes the images of `manifest` into `dir`. Returns the bytes fetched from the store.
    pub async fn materialize(
        &self,
        manifest: &Manifest,
        dir: &Path,
        progress: Progress,
    ) -> Result<u64, StoreError> {
        self.refresh_index().await?;
        let id = manifest.id.as_str();
        let corrupt =
            |what: &str, reason: String| StoreError::Corrupt { id: id.into(), file: what.into(), reason };
        let local = |path: &Path| {
            let path = path.display().to_string();
            move |source| StoreError::Local { path, source }
        };
        let mut plan: HashMap<Arc<str>, Vec<Placement>> = HashMap::new();
        for file in &manifest.files {
            if file.name.contains('/') || file.name.starts_with('.') || file.name.is_empty() {
                return Err(corrupt(&file.name, "the manifest names an unsafe file path".into()));
            }
            let path = dir.join(&file.name);
            let out = create_sized(&path, file.size).map_err(local(&path))?;
            let placed = self.place(id, &file.name, &file.chunks, out, &mut plan)?;
            if placed != file.size {
                return Err(corrupt(
                    &file.name,
                    format!("chunks hold {placed} bytes, the file {}", file.size),
                ));
            }
        }
        for (i, image) in manifest.memory.iter().enumerate() {
            let name = pagemap_file_name(image.dst_id)
                .ok_or_else(|| corrupt("memory", format!("unknown pagemap id {:#x}", image.dst_id)))?;
            let pages_id = i as u32 + 1;
            let runs: Vec<PageRun> = image
                .runs
                .iter()
                .map(|r| PageRun {
                    dst_id: image.dst_id,
                    vaddr: r.vaddr,
                    nr_pages: r.nr_pages,
                    flags: r.flags,
                })
                .collect();
            let present: u64 = runs.iter().filter(|r| r.has_data()).map(PageRun::byte_len).sum();
            let pagemap = dir.join(&name);
            write_pagemap(&pagemap, pages_id, &runs).map_err(local(&pagemap))?;
            let pages = dir.join(pages_file_name(pages_id));
            let out = create_sized(&pages, present).map_err(local(&pages))?;
            let placed = self.place(id, &name, &image.chunks, out, &mut plan)?;
            if placed != present {
                return Err(corrupt(&name, format!("chunks hold {placed} bytes, its pages {present}")));
            }
        }

        let total: u64 = plan.values().flatten().map(|p| u64::from(p.loc.stored_len)).sum();
        let fetched = Arc::new(AtomicU64::new(0));
        futures::stream::iter(plan)
            .map(|(pack, placements)| {
                let fetched = fetched.clone();
                let progress = progress.clone();
                async move {
                    let bytes = self.fetch_pack(id, &pack, placements).await?;
                    progress(fetched.fetch_add(bytes, Ordering::Relaxed) + bytes, total);
                    Ok::<_, StoreError>(())
                }
            })
            .buffer_unordered(PACKS_IN_FLIGHT)
            .try_collect::<()>()
            .await?;
        Ok(fetched.load(Ordering::Relaxed))
    }

    /// Resolves `chunks` to pack locations, to be written consecutively into `file`; returns
    /// the bytes they cover. Zero chunks need no fetch: the file is created zero-filled.
    fn place(
        &self,
        id: &str,
        what: &str,
        chunks: &[ChunkRef],
        file: File,
        plan: &mut HashMap<Arc<str>, Vec<Placement>>,
    ) -> Result<u64, StoreError> {
        let file = Arc::new(file);
        let mut offset = 0u64;
        for chunk in chunks {
            if !chunk.hash.is_empty() {
                let hash = ChunkHash::try_from(chunk.hash.as_slice()).map_err(|_| StoreError::Corrupt {
                    id: id.into(),
                    file: what.into(),
                    reason: "a chunk reference has a malformed hash".into(),
                })?;
                let loc =
                    self.index.get(&hash).filter(|l| l.len == chunk.len).ok_or_else(|| {
                        StoreError::MissingChunk { id: id.into(), chunk: hex::encode(hash) }
                    })?;
                plan.entry(loc.pack.clone()).or_default().push(Placement {
                    loc,
                    hash,
                    file: file.clone(),
                    offset,
                });
            }
            offset += u64::from(chunk.len);
        }
        Ok(offset)
    }

    /// Fetches the chunks of one pack with range reads and writes them in place.
    async fn fetch_pack(&self, id: &str, pack: &str, placements: Vec<Placement>) -> Result<u64, StoreError> {
        let key = self.pack_key(pack);
        let ranges: Vec<std::ops::Range<u64>> =
            placements.iter().map(|p| p.loc.offset..p.loc.offset + u64::from(p.loc.stored_len)).collect();
        let blobs = match self.backend.get_ranges(&key, &ranges).await {
            Ok(b) => b,
            Err(source) => return Err(self.explain_fetch_failure(id, pack, &ranges, source).await),
        };
        let fetched: u64 = blobs.iter().map(|b| b.len() as u64).sum();
        let (id, pack) = (id.to_string(), pack.to_string());
        tokio::task::spawn_blocking(move || {
            for (blob, p) in blobs.iter().zip(&placements) {
                let bad = |reason: &str| StoreError::CorruptChunk {
                    id: id.clone(),
                    chunk: hex::encode(p.hash),
                    pack: pack.clone(),
                    reason: reason.into(),
                };
                if blob.len() != p.loc.stored_len as usize {
                    return Err(bad("the pack is truncated"));
                }
                let data = match p.loc.codec {
                    Codec::Raw => blob.to_vec(),
                    Codec::Zstd => zstd::bulk::decompress(blob, p.loc.len as usize)
                        .map_err(|_| bad("it does not decompress"))?,
                };
                if data.len() != p.loc.len as usize || blake3::hash(&data).as_bytes() != &p.hash {
                    return Err(bad("its content does not match its hash"));
                }
                p.file
                    .write_all_at(&data, p.offset)
                    .map_err(|source| StoreError::Local { path: "image file".into(), source })?;
            }
            Ok(fetched)
        })
        .await
        .map_err(|e| StoreError::Local { path: "restore worker".into(), source: std::io::Error::other(e) })?
    }
}

impl Store {
    /// Names what is wrong when reading ranges of a pack failed: a missing pack, a pack
    /// shorter than its index says (truncated), or the backend's own error.
    async fn explain_fetch_failure(
        &self,
        id: &str,
        pack: &str,
        ranges: &[std::ops::Range<u64>],
        source: object_store::Error,
    ) -> StoreError {
        let key = self.pack_key(pack);
        let needed = ranges.iter().map(|r| r.end).max().unwrap_or(0);
        match self.backend.head(&key).await {
            Err(object_store::Error::NotFound { .. }) => {
                StoreError::MissingPack { id: id.into(), pack: pack.into() }
            }
            Ok(meta) if meta.size < needed => StoreError::Corrupt {
                id: id.into(),
                file: format!("pack {pack}"),
                reason: format!("truncated: {} bytes stored, chunks extend to {needed}", meta.size),
            },
            _ => StoreError::Backend { key: key.to_string(), source },
        }
    }
}

fn create_sized(path: &Path, size: u64) -> std::io::Result<File> {
    let file = File::options().read(true).write(true).create_new(true).open(path)?;
    file.set_len(size)?;
    Ok(file)
}
