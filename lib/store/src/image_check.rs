//! Whether a stored checkpoint's images are a set CRIU can restore (see `criu::image_set`):
//! the few small images that refer to others are fetched from the store and followed, the
//! pagemaps being those of the manifest's memory images. Chunks are found where the check
//! found them (the pack indexes it read), not in this node's chunk index, which may not know
//! packs other nodes wrote or this stasisd has not read since it started.

use std::collections::HashMap;

use stasis_proto::stasis::store::v1::FileImage;

use super::index::{ChunkHash, ChunkLoc};
use super::{Manifest, Store, StoreError};
use stasis_criu_images::image_set::{ImageSetError, check, image_names, read_by_check};

/// Where each chunk of the store is, as the check read the pack indexes.
pub(super) type Locations = HashMap<ChunkHash, Vec<ChunkLoc>>;

impl Store {
    /// Why checkpoint `m`'s images are not a set CRIU can restore, if they are not (the inner
    /// result); the outer error when the images it reads could not be fetched.
    pub(super) async fn check_image_set(
        &self,
        m: &Manifest,
        locations: &Locations,
    ) -> Result<Result<(), ImageSetError>, StoreError> {
        let names = image_names(m.files.iter().map(|f| f.name.as_str()), m.memory.iter().map(|i| i.dst_id));
        let read =
            m.files.iter().filter(|f| read_by_check(&f.name)).map(|f| self.read_file(&m.id, f, locations));
        let contents: HashMap<String, Vec<u8>> =
            futures::future::try_join_all(read).await?.into_iter().collect();
        Ok(check(&names, &contents))
    }

    /// Image file `file` of checkpoint `id` (its name and bytes), fetched and verified.
    async fn read_file(
        &self,
        id: &str,
        file: &FileImage,
        locations: &Locations,
    ) -> Result<(String, Vec<u8>), StoreError> {
        let mut data = Vec::with_capacity(usize::try_from(file.size).unwrap_or(0).min(1 << 20));
        for chunk in &file.chunks {
            let find = |hash: &ChunkHash| locations.get(hash)?.first().cloned();
            data.extend_from_slice(&self.read_chunk(id, &file.name, chunk, find).await?);
        }
        if data.len() as u64 != file.size {
            return Err(StoreError::Corrupt {
                id: id.into(),
                file: file.name.clone(),
                reason: format!("chunks hold {} bytes, the file {}", data.len(), file.size),
            });
        }
        Ok((file.name.clone(), data))
    }
}

#[cfg(test)]
mod tests {
    use std::path::Path;
    use std::sync::Arc;

    use super::*;
    use crate::{DumpPages, Staging, StagingBudget};
    use stasis_criu_images::pages::{PAGE_SIZE, PE_PRESENT, PageRun, PageSink};
    use stasis_criu_images::testing::write_dump_images;

    /// Stores the dump in `dir/<id>` of process 9 (one page of its memory) whose shared memory
    /// `opened` CRIU opened without sending pages; commits it as checkpoint `id`.
    async fn stored(store: &Store, dir: &Path, id: &str, opened: &[u64]) -> Result<Manifest, StoreError> {
        let mut staging = Staging::new(&StagingBudget::new(1 << 20), &dir.join(format!("{id}.spill")));
        staging.open((9 << 8) | 1).unwrap();
        let run = PageRun { dst_id: (9 << 8) | 1, vaddr: 0x10000, nr_pages: 1, flags: PE_PRESENT };
        staging.run(run, &mut &vec![7u8; PAGE_SIZE as usize][..]).unwrap();
        opened.iter().for_each(|&shmid| staging.open((shmid << 8) | 2).unwrap());
        let pages = DumpPages::Staged(Arc::new(staging.finish().unwrap()));
        let dump = store.store_dump(pages, &dir.join(id), &[], Arc::new(|_, _| {})).await?;
        let manifest =
            Manifest { id: id.into(), files: dump.files, memory: dump.memory, ..Default::default() };
        store.commit(&manifest, &store.begin_commit().await.unwrap()).await.unwrap();
        Ok(manifest)
    }

    #[tokio::test(flavor = "multi_thread")]
    async fn a_dump_or_checkpoint_missing_a_shared_memory_pagemap_is_refused_and_reported() {
        let dir = tempfile::tempdir().unwrap();
        let store = Store::in_dir(&dir.path().join("store"));
        let (whole, old) = ("20261126-000001-aaaaaa", "20261126-000002-bbbbbb");
        for id in [whole, old] {
            std::fs::create_dir_all(dir.path().join(id)).unwrap();
            write_dump_images(&dir.path().join(id), 9, &[31]);
        }
        // A shared mapping never written: CRIU opens its pagemap and sends no page of it.
        let manifest = stored(&store, dir.path(), whole, &[31]).await.unwrap();
        assert_eq!(manifest.memory.len(), 2, "the empty image is kept: {:?}", manifest.memory);
        assert!(manifest.memory[1].runs.is_empty() && manifest.memory[1].chunks.is_empty());
        // Checked by a stasisd that has read no pack index since it started (a restart), too.
        let fresh = Store::in_dir(&dir.path().join("store"));
        let report = fresh.check(false).await.unwrap();
        assert!(report.broken.is_empty() && report.problems.is_empty(), "{report:?}");

        // Without it, the dump is refused (it would never restore).
        let refused = stored(&store, dir.path(), old, &[]).await.unwrap_err();
        let chain = stasis_errors::error_chain(&refused);
        assert!(matches!(refused, StoreError::Images(_)), "{chain}");
        assert!(chain.contains("pagemap-shmem-31.img (for the shared memory at 0x70000000"), "{chain}");

        // A checkpoint stored so before the fix is found broken by `stasis check`.
        let mut broken = manifest.clone();
        broken.id = old.into();
        broken.memory.truncate(1);
        store.commit(&broken, &store.begin_commit().await.unwrap()).await.unwrap();
        let report = store.check(false).await.unwrap();
        assert_eq!(report.broken.keys().collect::<Vec<_>>(), [old], "{report:?}");
        assert!(report.broken[old][0].contains("pagemap-shmem-31.img"), "{report:?}");
        assert!(
            report.problems.iter().any(|p| p.contains(old) && p.contains("pagemap-shmem-31.img")),
            "{report:?}"
        );
    }
}
