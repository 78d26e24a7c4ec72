//! Storing a dump: chunking on a blocking thread, pack uploads in parallel (bounded), pack
//! index objects after their packs, and the chunk index updated as packs land.

use std::collections::HashMap;
use std::path::Path;
use std::sync::Arc;

use object_store::path::Path as ObjPath;
use object_store::{PutPayload, WriteMultipart};
use stasis_proto::stasis::v1::{FileImage, MemoryImage, PageRun as StoredRun};
use tokio::sync::{Semaphore, mpsc};
use tokio::task::JoinSet;

use super::chunks::{ChunkStats, ChunkWriter, FinishedPack, UploaderGone, split_aligned};
use super::staging::Staged;
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
        let files = read_images(images_dir, skip).await?;
        let total = staged.len() + files.iter().map(|(_, d)| d.len() as u64).sum::<u64>();
        let (tx, mut rx) = mpsc::channel::<FinishedPack>(PACKS_QUEUED);
        let index = self.index.clone();
        let tag = self.node_tag.clone();
        let producer = tokio::task::spawn_blocking(move || {
            let mut writer = ChunkWriter::new(&index, tx, &tag);
            let mut done = 0u64;
            let memory = memory_images(&staged, &mut writer, &mut |n| {
                done += n;
                progress(done, total);
            })?;
            let mut images = Vec::with_capacity(files.len());
            for (name, data) in files {
                let pieces: Vec<&[u8]> = split_aligned(0, &data).collect();
                let chunks = writer.write(&pieces)?;
                images.push(FileImage { name, size: data.len() as u64, chunks });
            }
            writer.flush()?;
            Ok::<_, UploaderGone>((memory, images, writer.stats))
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
        let (memory, files, chunks) = produced.map_err(|UploaderGone| StoreError::Local {
            path: images_dir.display().to_string(),
            source: std::io::Error::other("pack uploader stopped"),
        })?;
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
        let index = envelope::encode(envelope::PACK_INDEX, &pack.index);
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

/// Groups staged runs by destination (keeping CRIU's order) and chunks their bytes.
fn memory_images(
    staged: &Staged,
    writer: &mut ChunkWriter<'_>,
    advance: &mut dyn FnMut(u64),
) -> Result<Vec<MemoryImage>, UploaderGone> {
    let mut order: Vec<u64> = Vec::new();
    let mut groups: HashMap<u64, Vec<usize>> = HashMap::new();
    for (i, r) in staged.runs().iter().enumerate() {
        groups.entry(r.run.dst_id).or_insert_with(|| {
            order.push(r.run.dst_id);
            Vec::new()
        });
        groups.get_mut(&r.run.dst_id).expect("group just made").push(i);
    }
    let mut images = Vec::with_capacity(order.len());
    for dst_id in order {
        let mut image = MemoryImage { dst_id, ..Default::default() };
        for &i in &groups[&dst_id] {
            let staged_run = &staged.runs()[i];
            let run = staged_run.run;
            image.runs.push(StoredRun { vaddr: run.vaddr, nr_pages: run.nr_pages, flags: run.flags });
            let bytes = staged.bytes(staged_run);
            let pieces: Vec<&[u8]> = split_aligned(run.vaddr, bytes).collect();
            image.chunks.extend(writer.write(&pieces)?);
            staged.release(staged_run);
            advance(bytes.len() as u64);
        }
        images.push(image);
    }
    Ok(images)
}

/// The regular files of `dir` except `skip`, sorted by name.
async fn read_images(dir: &Path, skip: &[&str]) -> Result<Vec<(String, Vec<u8>)>, StoreError> {
    let local = |path: &Path| {
        let path = path.display().to_string();
        move |source| StoreError::Local { path, source }
    };
    let mut out = Vec::new();
    let mut entries = tokio::fs::read_dir(dir).await.map_err(local(dir))?;
    while let Some(entry) = entries.next_entry().await.map_err(local(dir))? {
        let name = entry.file_name().to_string_lossy().into_owned();
        let meta = entry.metadata().await.map_err(local(&entry.path()))?;
        if meta.is_file() && !skip.contains(&name.as_str()) {
            out.push((name, tokio::fs::read(entry.path()).await.map_err(local(&entry.path()))?));
        }
    }
    out.sort();
    Ok(out)
}
