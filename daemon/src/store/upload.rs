//! Storing a dump: chunking on a blocking thread, pack uploads in parallel (bounded), pack
//! index objects after their packs, and the chunk index updated as packs land.

use std::collections::HashMap;
use std::io::Read;
use std::path::{Path, PathBuf};
use std::sync::Arc;

use object_store::path::Path as ObjPath;
use object_store::{PutPayload, WriteMultipart};
use stasis_proto::stasis::v1::{ChunkRef, FileImage, MemoryImage, PageRun as StoredRun};
use tokio::sync::{Semaphore, mpsc};
use tokio::task::JoinSet;

use super::chunks::{CHUNK, ChunkStats, ChunkWriter, FinishedPack, UploaderGone, aligned_windows};
use super::staging::{Staged, StagedRun};
use super::{Progress, Store, StoreError, envelope};

/// Packs uploaded at the same time.
const UPLOADS_IN_FLIGHT: usize = 4;
/// Finished packs waiting for an upload slot.
const PACKS_QUEUED: usize = 2;
/// Part size of multipart pack uploads.
const PART: usize = 8 << 20;

/// What a stored dump consists of, for its manifest.
#[derive(Debug, Clone, Default)]
pub struct StoredDump {
    pub memory: Vec<MemoryImage>,
    pub files: Vec<FileImage>,
    pub chunks: ChunkStats,
    /// Bytes written to the store (compressed packs and their indexes).
    pub bytes_uploaded: u64,
    /// Ids of the packs written.
    pub packs: Vec<String>,
}

impl Store {
    pub(super) fn pack_key(&self, pack: &str) -> ObjPath {
        self.key(&format!("packs/{pack}.pack"))
    }

    pub(super) fn pack_index_key(&self, pack: &str) -> ObjPath {
        self.key(&format!("packs/{pack}.idx"))
    }

    /// Stores the staged pages and the image files of `images_dir` (except `skip`) as chunks.
    /// Nothing references them until a manifest is committed.
    pub async fn store_dump(
        &self,
        staged: Arc<Staged>,
        images_dir: &Path,
        skip: &[&str],
        progress: Progress,
    ) -> Result<StoredDump, StoreError> {
        let files = list_images(images_dir, skip).await?;
        let total = staged.len() + files.iter().map(|(_, _, size)| size).sum::<u64>();
        let stopped = uploader_stopped(images_dir);
        let (tx, mut rx) = mpsc::channel::<FinishedPack>(PACKS_QUEUED);
        let index = self.index.clone();
        let tag = self.node_tag.clone();
        let (cipher, slots) = (self.cipher.clone(), self.pack_slots.clone());
        let producer = tokio::task::spawn_blocking(move || {
            let mut writer = ChunkWriter::new(&index, tx, &tag, cipher.as_deref(), slots);
            let mut done = 0u64;
            let memory = memory_images(&staged, &mut writer, &mut |n| {
                done += n;
                progress(done, total);
            })
            .map_err(|UploaderGone| stopped())?;
            let mut images = Vec::with_capacity(files.len());
            for (name, path, size) in files {
                let chunks = chunk_file(&mut writer, &path, size).map_err(|e| e.unwrap_or_else(&stopped))?;
                images.push(FileImage { name, size, chunks });
            }
            writer.flush().map_err(|UploaderGone| stopped())?;
            Ok::<_, StoreError>((memory, images, writer.stats))
        });

        let slots = Arc::new(Semaphore::new(UPLOADS_IN_FLIGHT));
        let mut uploads = JoinSet::new();
        let mut outcome = StoredDump::default();
        let mut failure = None;
        while let Some(pack) = rx.recv().await {
            let slot = slots.clone().acquire_owned().await.expect("semaphore never closed");
            let store = self.clone();
            uploads.spawn(async move {
                let id = pack.index.pack.clone();
                let result = store.upload_pack(pack).await;
                drop(slot);
                result.map(|bytes| (id, bytes))
            });
            while let Some(done) = uploads.try_join_next() {
                record(done, &mut outcome, &mut failure);
            }
            if failure.is_some() {
                break;
            }
        }
        drop(rx);
        while let Some(done) = uploads.join_next().await {
            record(done, &mut outcome, &mut failure);
        }
        let produced = producer.await.map_err(|e| StoreError::Local {
            path: images_dir.display().to_string(),
            source: std::io::Error::other(e),
        })?;
        if let Some(e) = failure {
            return Err(e);
        }
        let (memory, files, chunks) = produced?;
        Ok(StoredDump { memory, files, chunks, ..outcome })
    }

    /// Uploads a pack, then its index; returns the bytes written.
    pub(super) async fn upload_pack(&self, pack: FinishedPack) -> Result<u64, StoreError> {
        let key = self.pack_key(&pack.index.pack);
        let size = pack.data.len() as u64;
        let upload = self.backend.put_multipart(&key).await.map_err(Self::backend_err(&key))?;
        let mut writer = WriteMultipart::new_with_chunk_size(upload, PART);
        writer.write(&pack.data);
        writer.finish().await.map_err(Self::backend_err(&key))?;
        let index_key = self.pack_index_key(&pack.index.pack);
        let index = envelope::encode(envelope::PACK_INDEX, &pack.index, self.cipher());
        let index_size = index.len() as u64;
        self.backend.put(&index_key, PutPayload::from(index)).await.map_err(Self::backend_err(&index_key))?;
        self.index.add(&pack.index);
        Ok(size + index_size)
    }
}

fn record(
    done: Result<Result<(String, u64), StoreError>, tokio::task::JoinError>,
    outcome: &mut StoredDump,
    failure: &mut Option<StoreError>,
) {
    match done {
        Ok(Ok((id, bytes))) => {
            outcome.bytes_uploaded += bytes;
            outcome.packs.push(id);
        }
        Ok(Err(e)) => {
            failure.get_or_insert(e);
        }
        Err(e) => {
            failure.get_or_insert(StoreError::Local {
                path: "pack upload".into(),
                source: std::io::Error::other(e),
            });
        }
    }
}

/// Groups staged runs by destination (keeping CRIU's order), joins the runs of each that
/// continue one another, and chunks their bytes.
///
/// CRIU cuts its transfers where its page-pipe buffers fill up, and those places move as soon
/// as an earlier mapping gains or loses a page. Joined, a stored run is a stretch of present
/// pages of the task's memory, and each chunk the part of an aligned window that stretch
/// covers: the same memory gives the same chunks wherever CRIU cut it.
fn memory_images(
    staged: &Staged,
    writer: &mut ChunkWriter<'_>,
    advance: &mut dyn FnMut(u64),
) -> Result<Vec<MemoryImage>, UploaderGone> {
    let mut order: Vec<u64> = Vec::new();
    let mut groups: HashMap<u64, Vec<&StagedRun>> = HashMap::new();
    for r in staged.runs() {
        groups.entry(r.run.dst_id).or_insert_with(|| {
            order.push(r.run.dst_id);
            Vec::new()
        });
        groups.get_mut(&r.run.dst_id).expect("group just made").push(r);
    }
    let mut images = Vec::with_capacity(order.len());
    for dst_id in order {
        let mut image = MemoryImage { dst_id, ..Default::default() };
        for joined in continuations(&groups[&dst_id]) {
            let first = joined[0].run;
            let nr_pages = joined.iter().map(|r| r.run.nr_pages).sum();
            image.runs.push(StoredRun { vaddr: first.vaddr, nr_pages, flags: first.flags });
            let pieces: Vec<&[u8]> = joined.iter().map(|r| staged.bytes(r)).collect();
            let windows = aligned_windows(first.vaddr, &pieces);
            image.chunks.extend(writer.write(&windows.iter().map(|w| w.as_ref()).collect::<Vec<_>>())?);
            joined.iter().for_each(|r| staged.release(r));
            advance(pieces.iter().map(|p| p.len() as u64).sum());
        }
        images.push(image);
    }
    Ok(images)
}

/// `runs` split where a run does not continue the one before it (same flags, starting where
/// it ends).
fn continuations<'a, 'r>(runs: &'a [&'r StagedRun]) -> impl Iterator<Item = &'a [&'r StagedRun]> {
    runs.chunk_by(|a, b| a.run.flags == b.run.flags && a.run.vaddr + a.run.byte_len() == b.run.vaddr)
}

/// The regular files of `dir` except `skip`, with their paths and sizes, sorted by name.
async fn list_images(dir: &Path, skip: &[&str]) -> Result<Vec<(String, PathBuf, u64)>, StoreError> {
    let mut out = Vec::new();
    let mut entries = tokio::fs::read_dir(dir).await.map_err(StoreError::local(dir))?;
    while let Some(entry) = entries.next_entry().await.map_err(StoreError::local(dir))? {
        let name = entry.file_name().to_string_lossy().into_owned();
        let meta = entry.metadata().await.map_err(StoreError::local(&entry.path()))?;
        if meta.is_file() && !skip.contains(&name.as_str()) {
            out.push((name, entry.path(), meta.len()));
        }
    }
    out.sort();
    Ok(out)
}

/// Bytes of a file chunked at a time: whole windows, so every block starts at one.
const FILE_BLOCK: usize = 64 * CHUNK;

/// Chunks the file at `path` (`size` bytes when listed) a block at a time, so that no file is
/// held in memory whole (an imported archive's `rootfs-diff.tar` may be large), and a small
/// one takes no more than its size. `Err(None)`: the uploader stopped.
fn chunk_file(
    writer: &mut ChunkWriter<'_>,
    path: &Path,
    size: u64,
) -> Result<Vec<ChunkRef>, Option<StoreError>> {
    let mut file = std::fs::File::open(path).map_err(|e| Some(StoreError::local(path)(e)))?;
    let block_len = usize::try_from(size).unwrap_or(FILE_BLOCK).clamp(1, FILE_BLOCK);
    let (mut block, mut chunks) = (vec![0u8; block_len], Vec::new());
    loop {
        let mut filled = 0;
        while filled < block.len() {
            match file.read(&mut block[filled..]) {
                Ok(0) => break,
                Ok(n) => filled += n,
                Err(e) if e.kind() == std::io::ErrorKind::Interrupted => {}
                Err(e) => return Err(Some(StoreError::local(path)(e))),
            }
        }
        let windows = aligned_windows(0, &[&block[..filled]]);
        chunks
            .extend(writer.write(&windows.iter().map(|w| w.as_ref()).collect::<Vec<_>>()).map_err(|_| None)?);
        if filled < block.len() {
            return Ok(chunks);
        }
    }
}

/// The error of a dump whose pack uploader stopped (its failure is reported instead).
fn uploader_stopped(images_dir: &Path) -> impl Fn() -> StoreError + Send + Sync + 'static {
    let path = images_dir.display().to_string();
    move || StoreError::Local { path: path.clone(), source: std::io::Error::other("pack uploader stopped") }
}

#[cfg(test)]
mod tests {

    use super::*;
    use crate::criu::pageserver::{PAGE_SIZE, PE_PRESENT, PageRun, PageSink};
    use crate::store::{Manifest, MemoryMode, Staging};

    const PAGE: usize = PAGE_SIZE as usize;

    /// Task 42's memory: 37 pages from 0x7f0000003000 (not window-aligned) and 5 pages at
    /// 0x7f0000100000, different bytes on every page.
    fn memory() -> Vec<(u64, Vec<u8>)> {
        let fill = |pages: usize, seed: u8| -> Vec<u8> {
            (0..pages * PAGE).map(|i| (i / PAGE) as u8 ^ seed ^ (i % 253) as u8).collect()
        };
        vec![(0x7f00_0000_3000, fill(37, 1)), (0x7f00_0010_0000, fill(5, 2))]
    }

    /// Stores `memory()` as CRIU would send it with its transfers cut after the page counts in
    /// `cuts` (per region, in order).
    async fn store_cut(store: &Store, dir: &Path, cuts: &[&[usize]]) -> StoredDump {
        let mut staging = Staging::new(&crate::store::StagingBudget::new(64 << 20), &dir.join("spill"));
        for ((vaddr, bytes), cuts) in memory().iter().zip(cuts) {
            let mut from = 0;
            for &to in cuts.iter().chain([&(bytes.len() / PAGE)]) {
                let run = PageRun {
                    dst_id: (42 << 8) | 1,
                    vaddr: vaddr + (from * PAGE) as u64,
                    nr_pages: (to - from) as u64,
                    flags: PE_PRESENT,
                };
                staging.run(run, &mut &bytes[from * PAGE..to * PAGE]).unwrap();
                from = to;
            }
        }
        let images = dir.join("images");
        std::fs::create_dir_all(&images).unwrap();
        store
            .store_dump(Arc::new(staging.finish().unwrap()), &images, &[], Arc::new(|_, _| {}))
            .await
            .unwrap()
    }

    #[tokio::test(flavor = "multi_thread")]
    async fn the_same_memory_gives_the_same_chunks_wherever_criu_cut_its_transfers() {
        let dir = tempfile::tempdir().unwrap();
        let store = Store::in_dir(&dir.path().join("store"));
        let first = store_cut(&store, &dir.path().join("a"), &[&[20], &[]]).await;
        assert_eq!(first.memory.len(), 1);
        let runs: Vec<(u64, u64)> = first.memory[0].runs.iter().map(|r| (r.vaddr, r.nr_pages)).collect();
        assert_eq!(runs, [(0x7f00_0000_3000, 37), (0x7f00_0010_0000, 5)], "one stored run per stretch");
        for cuts in [&[&[1usize, 2, 3, 17, 36][..], &[4][..]], &[&[16, 29][..], &[1, 2, 3][..]]] {
            let again = store_cut(&store, &dir.path().join(format!("{cuts:?}")), &cuts[..]).await;
            let (a, b) = (&again.memory[0], &first.memory[0]);
            assert_eq!(a.runs, b.runs, "cut at {cuts:?}");
            let hashes =
                |m: &MemoryImage| m.chunks.iter().map(|c| (c.hash.clone(), c.len)).collect::<Vec<_>>();
            assert_eq!(hashes(a), hashes(b), "cut at {cuts:?}");
            assert_eq!(again.chunks.chunks_new, 0, "nothing new to store (cut at {cuts:?})");
        }
        // And the joined runs restore byte for byte.
        let manifest =
            Manifest { id: "20261123-000000-abcdef".into(), memory: first.memory, ..Default::default() };
        let out = dir.path().join("restore");
        std::fs::create_dir_all(&out).unwrap();
        store.materialize_as(&manifest, &out, MemoryMode::Eager, Arc::new(|_, _| {})).await.unwrap();
        let expected: Vec<u8> = memory().into_iter().flat_map(|(_, b)| b).collect();
        assert_eq!(std::fs::read(out.join("pages-1.img")).unwrap(), expected);
    }

    #[tokio::test(flavor = "multi_thread")]
    async fn a_file_larger_than_a_block_is_chunked_as_a_whole_and_restores_byte_for_byte() {
        let dir = tempfile::tempdir().unwrap();
        let store = Store::in_dir(&dir.path().join("store"));
        let images = dir.path().join("images");
        std::fs::create_dir_all(&images).unwrap();
        let data: Vec<u8> = (0..FILE_BLOCK + 3 * CHUNK + 123).map(|i| (i * 7 + i / 4096) as u8).collect();
        std::fs::write(images.join("rootfs-diff.tar"), &data).unwrap();
        std::fs::write(images.join("empty"), b"").unwrap();
        let staging = Staging::new(&crate::store::StagingBudget::new(1 << 20), &dir.path().join("spill"));
        let staged = Arc::new(staging.finish().unwrap());
        let stored = store.store_dump(staged, &images, &[], Arc::new(|_, _| {})).await.unwrap();
        let file = stored.files.iter().find(|f| f.name == "rootfs-diff.tar").unwrap();
        assert_eq!(file.size, data.len() as u64);
        assert_eq!(file.chunks.len(), data.len().div_ceil(CHUNK), "one chunk per window across blocks");
        let manifest =
            Manifest { id: "20261123-000000-abcdef".into(), files: stored.files, ..Default::default() };
        let out = dir.path().join("restore");
        std::fs::create_dir_all(&out).unwrap();
        store.materialize_as(&manifest, &out, MemoryMode::Eager, Arc::new(|_, _| {})).await.unwrap();
        assert_eq!(std::fs::read(out.join("rootfs-diff.tar")).unwrap(), data);
        assert_eq!(std::fs::read(out.join("empty")).unwrap(), b"");
    }
}
