//! Storing a dump: chunking on a blocking thread, pack uploads in parallel (bounded), pack
//! index objects after their packs, and the chunk index updated as packs land.

use std::io::Read;
use std::path::{Path, PathBuf};
use std::sync::Arc;

use object_store::PutPayload;
use object_store::path::Path as ObjPath;
use stasis_proto::stasis::store::v1::{ChunkRef, FileImage, MemoryImage};
use tokio::sync::{Semaphore, mpsc};
use tokio::task::JoinSet;
use tracing::warn;

use super::chunks::{CHUNK, ChunkStats, ChunkWriter, FinishedPack, UploaderGone, aligned_windows};
use super::memory::{ChunkingError, StreamFailure, staged_images, streamed_images};
use super::pack_slots::PackBytes;
use super::parent::Parent;
use super::sift::Sifted;
use super::staging::Staged;
use super::stream::StreamSource;
use super::{Progress, Store, StoreError, envelope};
use stasis_criu_images::image_set::{check_dir, image_names};

/// Packs uploaded at the same time.
const UPLOADS_IN_FLIGHT: usize = 4;
/// Finished packs waiting for an upload slot.
const PACKS_QUEUED: usize = 2;
/// Part size of multipart pack uploads.
const PART: usize = 8 << 20;

/// A dump's pages, as [`Store::store_dump`] takes them.
pub enum DumpPages {
    /// Received whole before storing began (a tree's first checkpoint left running).
    Staged(Arc<Staged>),
    /// Sifted while CRIU sent them (a later checkpoint left running): only the new chunks are
    /// left to pack.
    Sifted(Box<Sifted>),
    /// Arriving while they are stored; runs in parent are the pages of the parent given.
    Streamed(StreamSource, Option<Parent>),
}

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

    /// Stores a dump's pages and the image files of `images_dir` (except `skip`) as chunks;
    /// the files are listed once the pages are stored (a streamed dump's CRIU has written them
    /// by then). Nothing references the chunks until a manifest is committed.
    pub async fn store_dump(
        &self,
        pages: DumpPages,
        images_dir: &Path,
        skip: &[&str],
        progress: Progress,
    ) -> Result<StoredDump, StoreError> {
        let stopped = uploader_stopped(images_dir);
        let (tx, mut rx) = mpsc::channel::<FinishedPack>(PACKS_QUEUED);
        let index = self.index.clone();
        let tag = self.node_tag.clone();
        let (cipher, slots, compression) = (self.cipher.clone(), self.pack_slots.clone(), self.compression);
        let dir = images_dir.to_path_buf();
        let skip: Vec<String> = skip.iter().map(|s| s.to_string()).collect();
        let producer = tokio::task::spawn_blocking(move || {
            let mut writer =
                ChunkWriter::new(&index, tx, &tag, cipher.as_deref(), slots).compressing(compression);
            let known = match &pages {
                DumpPages::Staged(staged) => staged.len(),
                DumpPages::Sifted(sifted) => sifted.new_bytes(),
                DumpPages::Streamed(..) => 0,
            };
            let mut done = 0u64;
            // A streamed dump's size is known only once it ends: its total is 0, unknown (a
            // total reached is an end, which a caller passes on at once, for every block).
            let mut advance = |n| {
                done += n;
                progress(done, if known == 0 { 0 } else { known.max(done) });
            };
            let memory = match pages {
                DumpPages::Staged(staged) => {
                    staged_images(&staged, &mut writer, &mut advance).map_err(|failure| match failure {
                        ChunkingError::Sink(UploaderGone) => stopped(),
                        ChunkingError::Parent(e) => StoreError::Parent(e),
                    })?
                }
                DumpPages::Sifted(sifted) => {
                    sifted
                        .each_new(FILE_BLOCK / CHUNK, |chunks| {
                            writer.write_new(chunks)?;
                            advance(chunks.iter().map(|(_, raw)| raw.len() as u64).sum());
                            Ok(())
                        })
                        .map_err(|UploaderGone| stopped())?;
                    writer.stats = sifted.stats();
                    sifted.into_memory()
                }
                DumpPages::Streamed(source, parent) => {
                    streamed_images(source, parent, &mut writer, &mut advance).map_err(|failure| {
                        match failure {
                            StreamFailure::Chunking(ChunkingError::Sink(UploaderGone)) => stopped(),
                            StreamFailure::Chunking(ChunkingError::Parent(e)) => StoreError::Parent(e),
                            StreamFailure::Unfinished(_) => StoreError::DumpUnfinished,
                        }
                    })?
                }
            };
            let files = list_images(&dir, &skip)?;
            // Nothing is committed that CRIU cannot restore (issue 24: a shared mapping never
            // written once had no pagemap).
            let names =
                image_names(files.iter().map(|(name, ..)| name.as_str()), memory.iter().map(|m| m.dst_id));
            check_dir(&dir, &names).map_err(|e| {
                warn!(images = %dir.display(), error = %e, "a dump's image set is incomplete");
                StoreError::Images(e)
            })?;
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
        let mut upload = self.backend.put_multipart(&key).await.map_err(Self::backend_err(&key))?;
        let data = bytes::Bytes::from_owner(PackBytes { data: pack.data, slot: pack.slot });
        let parts: Vec<_> = (0..data.len())
            .step_by(PART)
            .map(|at| upload.put_part(data.slice(at..(at + PART).min(data.len())).into()))
            .collect();
        let uploaded = match futures::future::try_join_all(parts).await {
            Ok(_) => upload.complete().await,
            Err(e) => Err(e),
        };
        if let Err(e) = uploaded {
            // Parts already stored are kept (and billed), invisible to listing, until the
            // upload is aborted.
            if let Err(abort) = upload.abort().await {
                warn!(pack = %key, error = %abort, "cannot abort a failed pack upload; a bucket lifecycle rule removes its parts");
            }
            return Err(Self::backend_err(&key)(e));
        }
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

/// The regular files of `dir` except `skip`, with their paths and sizes, sorted by name.
fn list_images(dir: &Path, skip: &[String]) -> Result<Vec<(String, PathBuf, u64)>, StoreError> {
    let mut out = Vec::new();
    for entry in std::fs::read_dir(dir).map_err(StoreError::local(dir))? {
        let entry = entry.map_err(StoreError::local(dir))?;
        let name = entry.file_name().to_string_lossy().into_owned();
        let meta = entry.metadata().map_err(StoreError::local(&entry.path()))?;
        if meta.is_file() && !skip.contains(&name) {
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
    use crate::{Manifest, MemoryMode, Staging};
    use stasis_criu_images::pages::{PAGE_SIZE, PE_PRESENT, PageRun, PageSink};
    use stasis_criu_images::testing::write_dump_images;

    const PAGE: usize = PAGE_SIZE as usize;

    /// Task 42's memory: 37 pages from 0x7f0000003000 (not window-aligned) and 5 pages at
    /// 0x7f0000100000, different bytes on every page.
    fn memory() -> Vec<(u64, Vec<u8>)> {
        let fill = |pages: usize, seed: u8| -> Vec<u8> {
            (0..pages * PAGE).map(|i| (i / PAGE) as u8 ^ seed ^ (i % 253) as u8).collect()
        };
        vec![(0x7f00_0000_3000, fill(37, 1)), (0x7f00_0010_0000, fill(5, 2))]
    }

    /// Task 42's pages `from..to` of the region at `vaddr`, as CRIU sends them.
    fn task_run(vaddr: u64, from: usize, to: usize) -> PageRun {
        PageRun {
            dst_id: (42 << 8) | 1,
            vaddr: vaddr + (from * PAGE) as u64,
            nr_pages: (to - from) as u64,
            flags: PE_PRESENT,
        }
    }

    /// Stores `memory()` as CRIU would send it with its transfers cut after the page counts in
    /// `cuts` (per region, in order).
    async fn store_cut(store: &Store, dir: &Path, cuts: &[&[usize]]) -> StoredDump {
        let mut staging = Staging::new(&crate::StagingBudget::new(64 << 20), &dir.join("spill"));
        for ((vaddr, bytes), cuts) in memory().iter().zip(cuts) {
            let mut from = 0;
            for &to in cuts.iter().chain([&(bytes.len() / PAGE)]) {
                staging.run(task_run(*vaddr, from, to), &mut &bytes[from * PAGE..to * PAGE]).unwrap();
                from = to;
            }
        }
        let images = dir.join("images");
        std::fs::create_dir_all(&images).unwrap();
        write_dump_images(&images, 42, &[]);
        store
            .store_dump(
                DumpPages::Staged(Arc::new(staging.finish().unwrap())),
                &images,
                &[],
                Arc::new(|_, _| {}),
            )
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
    async fn a_dump_streamed_while_criu_sends_it_gives_the_images_of_a_staged_one() {
        let dir = tempfile::tempdir().unwrap();
        let staged =
            store_cut(&Store::in_dir(&dir.path().join("a")), &dir.path().join("sa"), &[&[20], &[]]).await;
        let store = Store::in_dir(&dir.path().join("b"));
        let images = dir.path().join("images");
        std::fs::create_dir_all(&images).unwrap();
        write_dump_images(&images, 42, &[]);
        let (mut sink, source) = crate::stream(&crate::BlockPool::default());
        let sender = std::thread::spawn(move || {
            // Another destination's run between task 42's, as CRIU never sends but might.
            let other = PageRun { dst_id: (43 << 8) | 1, vaddr: 0x1000, nr_pages: 1, flags: PE_PRESENT };
            for (i, (vaddr, bytes)) in memory().iter().enumerate() {
                for (from, to) in [(0, 3), (3, bytes.len() / PAGE)] {
                    sink.run(task_run(*vaddr, from, to), &mut &bytes[from * PAGE..to * PAGE]).unwrap();
                    if i == 0 && from == 0 {
                        sink.run(other, &mut &[9u8; PAGE][..]).unwrap();
                    }
                }
            }
            sink.finish().unwrap();
        });
        let reported = Arc::new(std::sync::Mutex::new(Vec::new()));
        let progress = {
            let reported = reported.clone();
            Arc::new(move |done, total| reported.lock().unwrap().push((done, total)))
        };
        let streamed =
            store.store_dump(DumpPages::Streamed(source, None), &images, &[], progress).await.unwrap();
        sender.join().unwrap();
        let reported = reported.lock().unwrap().clone();
        let sent: usize = memory().iter().map(|(_, b)| b.len()).sum::<usize>() + PAGE;
        assert_eq!(reported.last(), Some(&(sent as u64, 0)), "every byte, of a total not known");
        assert!(reported.iter().all(|&(_, total)| total == 0), "{reported:?}");
        let task = streamed.memory.iter().find(|m| m.dst_id == (42 << 8) | 1).unwrap();
        assert_eq!(task.runs, staged.memory[0].runs);
        assert_eq!(task.chunks, staged.memory[0].chunks);
        assert_eq!(streamed.memory.len(), 2, "the other destination has its own image");
        let names: Vec<&str> = streamed.files.iter().map(|f| f.name.as_str()).collect();
        assert_eq!(
            names,
            ["core-42.img", "inventory.img", "mm-42.img", "pstree.img"],
            "the image files are stored after the pages"
        );

        // A stream that ends without its end (the dump failed) stores nothing.
        let (mut sink, source) = crate::stream(&crate::BlockPool::default());
        let run = PageRun { dst_id: 1, vaddr: 0, nr_pages: 1, flags: PE_PRESENT };
        sink.run(run, &mut &[1u8; PAGE][..]).unwrap();
        drop(sink);
        let failed =
            store.store_dump(DumpPages::Streamed(source, None), &images, &[], Arc::new(|_, _| {})).await;
        assert!(matches!(failed, Err(StoreError::DumpUnfinished)), "{failed:?}");
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
        write_dump_images(&images, 42, &[]);
        let mut staging = Staging::new(&crate::StagingBudget::new(1 << 20), &dir.path().join("spill"));
        // A process with no page of memory still has its (empty) pagemap.
        staging.open((42 << 8) | 1).unwrap();
        let staged = Arc::new(staging.finish().unwrap());
        let stored =
            store.store_dump(DumpPages::Staged(staged), &images, &[], Arc::new(|_, _| {})).await.unwrap();
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
