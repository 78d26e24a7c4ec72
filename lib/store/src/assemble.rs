//! Rebuilding a CRIU image directory from a checkpoint: every chunk fetched (packs in
//! parallel, range reads coalesced by `object_store`), checked ([`decode_chunk`]),
//! decompressed, and written in place; pagemaps rebuilt from the manifest.

use std::borrow::Cow;
use std::collections::HashMap;
use std::fs::File;
use std::os::unix::fs::FileExt;
use std::path::Path;
use std::sync::Arc;
use std::sync::atomic::{AtomicU64, Ordering};

use futures::{StreamExt, TryStreamExt};
use stasis_proto::stasis::store::v1::{ChunkRef, FileImage, MemoryImage};

use super::codec;
use super::cow::SharedChunks;
use super::crypto::{Cipher, chunk_id};
use super::image_runs::{image_runs, split_run};
use super::index::{ChunkHash, ChunkLoc, stored_checksum};
use super::lazy_memory::{LazyChunk, LazyMemory};
use super::{Manifest, Progress, Store, StoreError};
use stasis_criu_images::images::{pagemap_file_name, pages_file_name, task_of, write_pagemap};
use stasis_criu_images::pages::{PE_LAZY, PageRun};
use stasis_proto::stasis::store::v1::AddressRange;

/// Packs one restore fetches at the same time.
const PACKS_IN_FLIGHT: usize = 8;

/// Pack fetches in memory at once, all restores together: with [`super::chunks::PACK_TARGET`],
/// what eager restores add to stasisd's memory however many run.
pub const FETCHES_IN_MEMORY: usize = 6;

/// A chunk to fetch and where its bytes go.
struct Placement {
    loc: ChunkLoc,
    hash: ChunkHash,
    /// The chunk's bytes that go there.
    part: std::ops::Range<usize>,
    file: Arc<File>,
    offset: u64,
}

/// Where every chunk a restore needs goes, by the pack that holds it.
type Plan = HashMap<Arc<str>, Vec<Placement>>;

/// A restore's images being laid out in `dir`: where each stored chunk goes, and which memory
/// stays in the store.
struct Assembly<'a> {
    id: &'a str,
    dir: &'a Path,
    mode: MemoryMode<'a>,
    plan: Plan,
    lazy: LazyMemory,
}

fn corrupt(id: &str, what: &str, reason: String) -> StoreError {
    StoreError::Corrupt { id: id.into(), file: what.into(), reason }
}

/// Which memory a restore leaves in the store, to be served on demand.
#[derive(Debug, Clone, Copy)]
pub enum MemoryMode<'a> {
    /// None: every page is written into the images directory.
    Eager,
    /// The pages CRIU may restore lazily (private anonymous memory of tasks), except those in
    /// `eager` (the host copies of device memory, which the CUDA restore reads at once) and
    /// those a child shares with its parent copy-on-write (CRIU's restore shares them only
    /// when it puts them in place itself: see `cow.rs`).
    Lazy { eager: &'a [AddressRange] },
}

impl MemoryMode<'_> {
    fn leaves_lazy(&self, dst_id: u64, run: &PageRun) -> bool {
        let Self::Lazy { eager } = self else { return false };
        let Some(pid) = task_of(dst_id) else { return false };
        let end = run.vaddr + run.byte_len();
        run.flags & PE_LAZY != 0
            && run.has_data()
            && !eager.iter().any(|r| r.pid as u64 == pid && r.start < end && r.end > run.vaddr)
    }
}

impl Store {
    /// Writes the images of `manifest` into `dir`. Returns the bytes fetched from the store.
    pub async fn materialize(
        &self,
        manifest: &Manifest,
        dir: &Path,
        progress: Progress,
    ) -> Result<u64, StoreError> {
        Ok(self.materialize_as(manifest, dir, MemoryMode::Eager, progress).await?.0)
    }

    /// Writes the images of `manifest` into `dir`, leaving the memory `mode` names in the
    /// store: pagemaps mark it lazy and no pages file holds it. Returns the bytes fetched and
    /// the memory left behind.
    pub async fn materialize_as(
        &self,
        manifest: &Manifest,
        dir: &Path,
        mode: MemoryMode<'_>,
        progress: Progress,
    ) -> Result<(u64, LazyMemory), StoreError> {
        self.refresh_index().await?;
        let id = manifest.id.as_str();
        let mut a = Assembly { id, dir, mode, plan: Plan::new(), lazy: LazyMemory::new(id) };
        for file in &manifest.files {
            self.plan_file(&mut a, file)?;
        }
        let (mut fetched, mut shared) = (0, SharedChunks::default());
        if matches!(mode, MemoryMode::Lazy { .. }) && manifest.memory.len() > 1 {
            // Which memory the tree shares is in its images: those come first.
            fetched += self.fetch_plan(id, std::mem::take(&mut a.plan), progress.clone()).await?;
            shared = SharedChunks::find(dir, &manifest.memory)
                .map_err(|reason| corrupt(id, "process images", reason))?;
        }
        for (i, image) in manifest.memory.iter().enumerate() {
            self.plan_memory(&mut a, image, i as u32 + 1, &shared)?;
        }
        let Assembly { plan, mut lazy, .. } = a;
        lazy.finish();
        fetched += self.fetch_plan(id, plan, progress).await?;
        Ok((fetched, lazy))
    }

    /// Creates image file `file` in `dir` and plans where its chunks go.
    fn plan_file(&self, a: &mut Assembly<'_>, file: &FileImage) -> Result<(), StoreError> {
        let (id, dir, plan) = (a.id, a.dir, &mut a.plan);
        if file.name.contains('/') || file.name.starts_with('.') || file.name.is_empty() {
            return Err(corrupt(id, &file.name, "the manifest names an unsafe file path".into()));
        }
        let path = dir.join(&file.name);
        let out = Arc::new(create_sized(&path, file.size).map_err(StoreError::local(&path))?);
        let placed = self.place(id, &file.name, &file.chunks, &out, 0, plan)?;
        if placed != file.size {
            return Err(corrupt(
                id,
                &file.name,
                format!("chunks hold {placed} bytes, the file {}", file.size),
            ));
        }
        Ok(())
    }

    /// Writes the pagemap of memory image `image` (its pages going to `pages-<pages_id>.img`)
    /// and plans where its chunks go; the runs `mode` leaves in the store go to `lazy`, but
    /// for the chunks in `shared`, which stay in the images.
    fn plan_memory(
        &self,
        a: &mut Assembly<'_>,
        image: &MemoryImage,
        pages_id: u32,
        shared: &SharedChunks,
    ) -> Result<(), StoreError> {
        let (id, dir, mode) = (a.id, a.dir, a.mode);
        let (plan, lazy) = (&mut a.plan, &mut a.lazy);
        let name = pagemap_file_name(image.dst_id)
            .ok_or_else(|| corrupt(id, "memory", format!("unknown pagemap id {:#x}", image.dst_id)))?;
        let pages = dir.join(pages_file_name(pages_id));
        let out = Arc::new(create_sized(&pages, 0).map_err(StoreError::local(&pages))?);
        let mut written = 0u64;
        let mut runs = Vec::with_capacity(image.runs.len());
        let pid = task_of(image.dst_id).unwrap_or(u64::MAX);
        for (run, chunks) in image_runs(image).map_err(|reason| corrupt(id, &name, reason))? {
            if !run.has_data() {
                runs.push(run);
                continue;
            }
            let lazy_run = mode.leaves_lazy(image.dst_id, &run);
            for (mut part, mine, in_images) in
                split_run(&run, chunks, |addr| !lazy_run || shared.contains(pid, addr))
            {
                if !in_images {
                    let resolved: Result<Vec<LazyChunk>, StoreError> = mine
                        .iter()
                        .map(|c| {
                            Ok(LazyChunk {
                                stored: self.resolve(id, &name, c)?,
                                offset: c.offset,
                                len: c.len,
                                fresh: c.fresh,
                            })
                        })
                        .collect();
                    lazy.push_run(image.dst_id >> 8, part.vaddr, resolved?);
                    part.flags = PE_LAZY;
                } else {
                    if matches!(mode, MemoryMode::Lazy { .. }) {
                        // CRIU's restore skips lazy-flagged pages in lazy mode: restoring this
                        // run eagerly means dropping the flag.
                        part.flags &= !PE_LAZY;
                    }
                    written += self.place(id, &name, mine, &out, written, plan)?;
                }
                runs.push(part);
            }
        }
        out.set_len(written).map_err(StoreError::local(&pages))?;
        let pagemap = dir.join(&name);
        write_pagemap(&pagemap, pages_id, &runs).map_err(StoreError::local(&pagemap))
    }

    /// Fetches every pack `plan` needs, several at a time, writing their chunks where the plan
    /// says. Returns the bytes fetched.
    async fn fetch_plan(&self, id: &str, plan: Plan, progress: Progress) -> Result<u64, StoreError> {
        // A chunk placed more than once (parts of it, memory processes share) is fetched once.
        let fetched_once: HashMap<(&str, u64), u32> =
            plan.values().flatten().map(|p| ((&*p.loc.pack, p.loc.offset), p.loc.stored_len)).collect();
        let total: u64 = fetched_once.values().map(|&len| u64::from(len)).sum();
        let fetched = Arc::new(AtomicU64::new(0));
        futures::stream::iter(plan)
            .map(|(pack, placements)| {
                let fetched = fetched.clone();
                let progress = progress.clone();
                async move {
                    let _slot = self.fetch_slots.acquire().await.expect("never closed");
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

    /// Where chunk `chunk` of `what` is stored, by the store's chunk index; `None` for a zero
    /// chunk.
    pub(super) fn resolve(
        &self,
        id: &str,
        what: &str,
        chunk: &ChunkRef,
    ) -> Result<Option<(ChunkHash, ChunkLoc)>, StoreError> {
        locate(id, what, chunk, |hash| self.index.get(hash))
    }

    /// Resolves `chunks` to pack locations, to be written consecutively into `file` from
    /// `start` on; returns the bytes they cover. Zero chunks need no fetch: files are created
    /// zero-filled.
    fn place(
        &self,
        id: &str,
        what: &str,
        chunks: &[ChunkRef],
        file: &Arc<File>,
        start: u64,
        plan: &mut HashMap<Arc<str>, Vec<Placement>>,
    ) -> Result<u64, StoreError> {
        let mut offset = start;
        for chunk in chunks {
            if let Some((hash, loc)) = self.resolve(id, what, chunk)? {
                let part = loc.part(chunk).expect("a resolved chunk holds what its reference takes");
                plan.entry(loc.pack.clone()).or_default().push(Placement {
                    loc,
                    hash,
                    part,
                    file: file.clone(),
                    offset,
                });
            }
            offset += u64::from(chunk.len);
        }
        Ok(offset - start)
    }

    /// Fetches the chunks of one pack with range reads and writes them in place.
    async fn fetch_pack(
        &self,
        id: &str,
        pack: &str,
        mut placements: Vec<Placement>,
    ) -> Result<u64, StoreError> {
        // A chunk with several places (memory processes share) is read and decoded once.
        placements.sort_by_key(|p| p.loc.offset);
        let mut ranges: Vec<std::ops::Range<u64>> =
            placements.iter().map(|p| p.loc.offset..p.loc.offset + u64::from(p.loc.stored_len)).collect();
        ranges.dedup();
        let blobs = self.read_ranges(id, pack, &ranges).await?;
        let fetched: u64 = blobs.iter().map(|b| b.len() as u64).sum();
        let (id, pack) = (id.to_string(), pack.to_string());
        let cipher = self.cipher.clone();
        tokio::task::spawn_blocking(move || {
            let mut blobs = ranges.iter().zip(&blobs);
            let mut data: (u64, Cow<[u8]>) = (u64::MAX, Cow::Borrowed(&[]));
            for p in &placements {
                if data.0 != p.loc.offset {
                    let bad = |reason: &str| StoreError::CorruptChunk {
                        id: id.clone(),
                        chunk: hex::encode(p.hash),
                        pack: pack.clone(),
                        reason: reason.into(),
                    };
                    let blob = blobs.find(|(r, _)| r.start == p.loc.offset).map(|(_, b)| b);
                    let blob = blob.ok_or_else(|| bad("it was not read"))?;
                    data = (
                        p.loc.offset,
                        decode_chunk(blob, &p.loc, &p.hash, cipher.as_deref(), Verify::Stored)
                            .map_err(bad)?,
                    );
                }
                p.file
                    .write_all_at(&data.1[p.part.clone()], p.offset)
                    .map_err(|source| StoreError::Local { path: "image file".into(), source })?;
            }
            Ok(fetched)
        })
        .await
        .map_err(|e| StoreError::Local { path: "restore worker".into(), source: std::io::Error::other(e) })?
    }
}

impl Store {
    /// The bytes chunk reference `chunk` of `what` (of checkpoint `id`) takes, its chunk found
    /// where `find` says, fetched alone and verified; zeros for a zero chunk.
    pub(super) async fn read_chunk(
        &self,
        id: &str,
        what: &str,
        chunk: &ChunkRef,
        find: impl FnOnce(&ChunkHash) -> Option<ChunkLoc>,
    ) -> Result<Vec<u8>, StoreError> {
        let (data, part) = self.read_whole_chunk(id, what, chunk, find).await?;
        Ok(take_part(data, part))
    }

    /// All the bytes of the chunk that reference `chunk` takes all or part of, as
    /// [`Self::read_chunk`] reads them, and which of them it takes.
    pub(super) async fn read_whole_chunk(
        &self,
        id: &str,
        what: &str,
        chunk: &ChunkRef,
        find: impl FnOnce(&ChunkHash) -> Option<ChunkLoc>,
    ) -> Result<(Vec<u8>, std::ops::Range<usize>), StoreError> {
        let Some((hash, loc)) = locate(id, what, chunk, find)? else {
            return Ok((vec![0; chunk.len as usize], 0..chunk.len as usize));
        };
        let range = loc.offset..loc.offset + u64::from(loc.stored_len);
        let blobs = self.read_ranges(id, &loc.pack, &[range]).await?;
        let blob = blobs.first().map_or(&[][..], |b| &b[..]);
        let data = decode_chunk(blob, &loc, &hash, self.cipher(), Verify::Stored)
            .map_err(|reason| StoreError::CorruptChunk {
                id: id.into(),
                chunk: hex::encode(hash),
                pack: loc.pack.to_string(),
                reason: reason.into(),
            })?
            .into_owned();
        Ok((data, loc.part(chunk).expect("a located chunk holds what its reference takes")))
    }

    /// Reads `ranges` of pack `pack` (for checkpoint `id`); a failure names what is wrong.
    pub(super) async fn read_ranges(
        &self,
        id: &str,
        pack: &str,
        ranges: &[std::ops::Range<u64>],
    ) -> Result<Vec<bytes::Bytes>, StoreError> {
        match self.backend.get_ranges(&self.pack_key(pack), ranges).await {
            Ok(blobs) => Ok(blobs),
            Err(source) => Err(self.explain_fetch_failure(id, pack, ranges, source).await),
        }
    }

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

/// How much of a fetched chunk [`decode_chunk`] checks.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(super) enum Verify {
    /// A chunk whose index records a checksum of its stored bytes is checked against that (its
    /// content is then what its writer stored under its id), any other against its id: what
    /// restores do.
    Stored,
    /// Both: what `stasis check --read-data` does, which would also find a chunk its writer
    /// stored under the wrong id.
    Everything,
}

/// A fetched chunk's bytes: checked as `verify` says, opened (in an encrypted store) and
/// decompressed; the error says why not. A chunk stored as it is, unencrypted, is `blob`
/// itself (not copied).
pub(super) fn decode_chunk<'a>(
    blob: &'a [u8],
    loc: &ChunkLoc,
    hash: &ChunkHash,
    cipher: Option<&Cipher>,
    verify: Verify,
) -> Result<Cow<'a, [u8]>, &'static str> {
    if blob.len() != loc.stored_len as usize {
        return Err("the pack is truncated");
    }
    if loc.stored_checksum.is_some_and(|sum| stored_checksum(blob) != sum) {
        return Err("its stored bytes do not match the checksum its index records");
    }
    let stored = match cipher {
        Some(c) => Cow::Owned(c.open(hash, blob).ok_or("it does not decrypt with the store key")?),
        None => Cow::Borrowed(blob),
    };
    let data = codec::decode(loc.codec, stored, loc.len as usize)?;
    let check_content = loc.stored_checksum.is_none() || verify == Verify::Everything;
    if check_content && &chunk_id(cipher, &data) != hash {
        return Err("its content does not match its hash");
    }
    Ok(data)
}

fn create_sized(path: &Path, size: u64) -> std::io::Result<File> {
    let file = File::options().read(true).write(true).create_new(true).open(path)?;
    file.set_len(size)?;
    Ok(file)
}

/// `data`, a chunk's bytes, cut to `part` of them (without a copy for all of them).
pub(super) fn take_part(data: Vec<u8>, part: std::ops::Range<usize>) -> Vec<u8> {
    if part.start == 0 && part.end == data.len() {
        return data;
    }
    data[part].to_vec()
}

/// Where chunk reference `chunk` of `what` (of checkpoint `id`) finds its chunk, as `find`
/// knows chunks; `None` for a zero chunk.
pub(super) fn locate(
    id: &str,
    what: &str,
    chunk: &ChunkRef,
    find: impl FnOnce(&ChunkHash) -> Option<ChunkLoc>,
) -> Result<Option<(ChunkHash, ChunkLoc)>, StoreError> {
    if chunk.hash.is_empty() {
        return Ok(None);
    }
    let hash = ChunkHash::try_from(chunk.hash.as_slice()).map_err(|_| StoreError::Corrupt {
        id: id.into(),
        file: what.into(),
        reason: "a chunk reference has a malformed hash".into(),
    })?;
    let loc =
        find(&hash).ok_or_else(|| StoreError::MissingChunk { id: id.into(), chunk: hex::encode(hash) })?;
    if loc.part(chunk).is_none() {
        return Err(StoreError::Corrupt {
            id: id.into(),
            file: what.into(),
            reason: format!(
                "a reference takes bytes {}..{} of chunk {}, which has {}",
                chunk.offset,
                u64::from(chunk.offset) + u64::from(chunk.len),
                hex::encode(hash),
                loc.len
            ),
        });
    }
    Ok(Some((hash, loc)))
}

#[cfg(test)]
#[path = "decode_tests.rs"]
mod tests;
