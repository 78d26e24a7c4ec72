//! Checkpoints for the store's tests, made the way a dump makes them: pages staged as CRIU
//! sends them, stored with a small image file, the manifest committed.

use std::path::{Path, PathBuf};
use std::sync::Arc;

use stasis_criu_images::pages::{PAGE_SIZE, PE_PRESENT, PageRun, PageSink};
use stasis_proto::stasis::store::v1::Manifest;

use crate::{DumpPages, Staging, StagingBudget, Store};

/// `n` bytes of a pseudo-random sequence seeded with `seed` (they do not compress; seeds 2k
/// and 2k + 1 give the same bytes).
pub fn noise(n: usize, seed: u64) -> Vec<u8> {
    let mut state = seed | 1;
    (0..n)
        .map(|_| {
            state ^= state << 13;
            state ^= state >> 7;
            state ^= state << 17;
            state as u8
        })
        .collect()
}

/// Memory of `pages` pages made from `seed` (it compresses well).
pub fn seeded(seed: u8, pages: usize) -> Vec<u8> {
    (0..pages * PAGE_SIZE as usize).map(|i| (i as u8).wrapping_mul(seed) ^ (i >> 12) as u8).collect()
}

/// Checkpoint `id` of workload `workload`: one process whose memory is `memory` from address
/// 0x10000 (a whole number of pages), and a small image file.
pub async fn checkpoint(store: &Store, dir: &Path, id: &str, workload: &str, memory: &[u8]) {
    let work = dir.join(id);
    std::fs::create_dir_all(work.join("images")).unwrap();
    stasis_criu_images::testing::write_dump_images(&work.join("images"), 1, &[]);
    std::fs::write(work.join("images/stats-of-1.img"), format!("stats of {id}")).unwrap();
    let mut staging = Staging::new(&StagingBudget::new(64 << 20), &work.join("spill"));
    let nr_pages = memory.len() as u64 / PAGE_SIZE;
    let run = PageRun { dst_id: (1 << 8) | 1, vaddr: 0x10000, nr_pages, flags: PE_PRESENT };
    staging.run(run, &mut &memory[..]).unwrap();
    let dump = store
        .store_dump(
            DumpPages::Staged(Arc::new(staging.finish().unwrap())),
            &work.join("images"),
            &[],
            Arc::new(|_, _| {}),
        )
        .await
        .unwrap();
    let manifest = Manifest {
        id: id.into(),
        workload: workload.into(),
        files: dump.files,
        memory: dump.memory,
        ..Default::default()
    };
    store.commit(&manifest, &store.begin_commit().await.unwrap()).await.unwrap();
}

/// The files of a store in `dir/store` whose names end with `suffix` (".pack", ".idx"),
/// sorted.
pub fn packs(dir: &Path, suffix: &str) -> Vec<PathBuf> {
    let mut found: Vec<_> = std::fs::read_dir(dir.join("store/packs"))
        .unwrap()
        .map(|e| e.unwrap().path())
        .filter(|p| p.to_string_lossy().ends_with(suffix))
        .collect();
    found.sort();
    found
}
