//! Verifying a store, as `restic check` does: every manifest reads and verifies, every pack
//! index reads, every pack is as long as its index says, every chunk a checkpoint references
//! is in such a pack, every checkpoint's images are a set CRIU can restore (each image the
//! others refer to is there: see `criu::image_set`), and with `read_data` every stored chunk
//! decompresses to the bytes of its hash. Each problem names what it breaks: the checkpoints
//! that reference what is bad.
//!
//! Garbage collection waits while a check runs (the same lock commits take), so a check never
//! reports a pack that collection removed under it.

use std::collections::{BTreeMap, HashMap, HashSet};

use stasis_proto::stasis::store::v1::{ChunkRef, Manifest};

use super::assemble::{Verify, decode_chunk};
use super::index::{ChunkHash, ChunkLoc};
use super::{Store, StoreError};

/// What a check found.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct CheckReport {
    pub manifests: usize,
    pub packs: usize,
    /// Chunks read back and verified (`read_data` only).
    pub chunks_read: u64,
    /// Of those, how many each codec stored ("raw", "zstd", "lz4"): what a change of the
    /// store's compression has reached so far.
    pub chunks_by_codec: BTreeMap<String, u64>,
    /// Each problem, in one sentence.
    pub problems: Vec<String>,
    /// The checkpoints that cannot be restored whole, and why.
    pub broken: BTreeMap<String, Vec<String>>,
    /// What is left over but harms nothing (packs of interrupted uploads, which gc removes).
    pub notes: Vec<String>,
}

impl CheckReport {
    fn breaks(&mut self, id: &str, why: String) {
        let reasons = self.broken.entry(id.to_string()).or_default();
        if !reasons.contains(&why) {
            reasons.push(why);
        }
    }
}

/// Why the chunks of a pack cannot be trusted.
type BadPacks = HashMap<String, String>;

impl Store {
    /// Checks the whole store; `read_data` also reads every pack and verifies every chunk.
    pub async fn check(&self, read_data: bool) -> Result<CheckReport, StoreError> {
        let _no_gc = self.gc_lock.read().await;
        let mut report = CheckReport::default();
        let listing = self.listing().await?;
        report.manifests = listing.manifests.len() + listing.unreadable.len();
        for (id, why) in &listing.unreadable {
            report.problems.push(format!("the manifest of checkpoint {id} is unreadable: {why}"));
            report.breaks(id, "its manifest is unreadable".into());
        }
        let (locations, mut bad_packs) = self.check_packs(&mut report).await?;
        let mut bad_chunks: HashMap<ChunkHash, String> = HashMap::new();
        if read_data {
            self.read_packs(&locations, &mut bad_packs, &mut bad_chunks, &mut report).await?;
        }
        for m in &listing.manifests {
            check_manifest(m, &locations, &bad_packs, &bad_chunks, &mut report);
            if !report.broken.contains_key(&m.id) {
                self.check_images(m, &locations, &mut report).await?;
            }
        }
        Ok(report)
    }

    /// Adds to `report` why the images of checkpoint `m` (whose chunks are all stored) are not
    /// a set CRIU can restore, if they are not.
    async fn check_images(
        &self,
        m: &Manifest,
        locations: &super::image_check::Locations,
        report: &mut CheckReport,
    ) -> Result<(), StoreError> {
        let why = match self.check_image_set(m, locations).await {
            Ok(Ok(())) => return Ok(()),
            Ok(Err(incomplete)) => incomplete.to_string(),
            Err(e @ (StoreError::Backend { .. } | StoreError::Busy(_) | StoreError::Local { .. })) => {
                return Err(e);
            }
            Err(unreadable) => {
                format!("its images cannot be read: {}", stasis_errors::error_chain(&unreadable))
            }
        };
        tracing::warn!(checkpoint = %m.id, reason = %why, "a checkpoint CRIU cannot restore");
        report.problems.push(format!("checkpoint {} cannot be restored: {why}", m.id));
        report.breaks(&m.id, why);
        Ok(())
    }

    /// Reads every pack index and checks each pack's size; returns where each chunk is stored
    /// and the packs that cannot be used.
    async fn check_packs(
        &self,
        report: &mut CheckReport,
    ) -> Result<(HashMap<ChunkHash, Vec<ChunkLoc>>, BadPacks), StoreError> {
        let packs = self.pack_objects().await?;
        let indexed: Vec<&String> = packs.iter().filter(|(_, p)| p.indexed).map(|(id, _)| id).collect();
        report.packs = indexed.len();
        let (mut locations, mut bad) = (HashMap::<ChunkHash, Vec<ChunkLoc>>::new(), BadPacks::new());
        for &pack in &indexed {
            let index = match self.read_pack_index(pack).await {
                Ok(index) => index,
                Err(e @ StoreError::Envelope { .. }) => {
                    let why = stasis_errors::error_chain(&e);
                    report.problems.push(format!("pack {pack}: {why}"));
                    bad.insert(pack.clone(), "its index is unreadable".into());
                    continue;
                }
                Err(e) => return Err(e),
            };
            let needed = super::index::reach(&index.entries);
            match packs[pack].size {
                None => {
                    report.problems.push(format!(
                        "pack {pack} is missing (its index lists {} chunks)",
                        index.entries.len()
                    ));
                    bad.insert(pack.clone(), "it is missing".into());
                }
                Some(size) if size < needed => {
                    report
                        .problems
                        .push(format!("pack {pack} is truncated: {size} bytes, its index needs {needed}"));
                    bad.insert(pack.clone(), "it is truncated".into());
                }
                Some(_) => {}
            }
            let pack_name: std::sync::Arc<str> = pack.as_str().into();
            for e in &index.entries {
                match ChunkLoc::of(&pack_name, e) {
                    Some((hash, loc)) => locations.entry(hash).or_default().push(loc),
                    None => report.problems.push(format!("pack {pack}: its index has a malformed entry")),
                }
            }
        }
        for (pack, _) in packs.iter().filter(|(_, p)| !p.indexed) {
            report.notes.push(format!("pack {pack} has no index (an interrupted upload; gc removes it)"));
        }
        Ok((locations, bad))
    }

    /// Reads every usable pack whole and verifies each of its chunks.
    async fn read_packs(
        &self,
        locations: &HashMap<ChunkHash, Vec<ChunkLoc>>,
        bad_packs: &mut BadPacks,
        bad_chunks: &mut HashMap<ChunkHash, String>,
        report: &mut CheckReport,
    ) -> Result<(), StoreError> {
        let mut by_pack: BTreeMap<&str, Vec<(&ChunkHash, &ChunkLoc)>> = BTreeMap::new();
        for (hash, locs) in locations {
            for loc in locs.iter().filter(|l| !bad_packs.contains_key(&*l.pack)) {
                by_pack.entry(&loc.pack).or_default().push((hash, loc));
            }
        }
        for (pack, chunks) in by_pack {
            let key = self.pack_key(pack);
            let data = match self.backend.get(&key).await {
                Ok(r) => r.bytes().await.map_err(Self::backend_err(&key))?,
                Err(object_store::Error::NotFound { .. }) => {
                    report.problems.push(format!("pack {pack} disappeared during the check"));
                    bad_packs.insert(pack.to_string(), "it is missing".into());
                    continue;
                }
                Err(source) => return Err(StoreError::Backend { key: key.to_string(), source }),
            };
            for (hash, loc) in chunks {
                report.chunks_read += 1;
                *report.chunks_by_codec.entry(super::codec::name(loc.codec).into()).or_default() += 1;
                let (start, end) = (loc.offset as usize, loc.offset as usize + loc.stored_len as usize);
                let blob = data.get(start..end).unwrap_or(&[]);
                if let Err(why) = decode_chunk(blob, loc, hash, self.cipher(), Verify::Everything) {
                    report
                        .problems
                        .push(format!("chunk {} in pack {pack} is corrupt: {why}", hex::encode(hash)));
                    bad_chunks
                        .insert(*hash, format!("chunk {} in pack {pack} is corrupt", hex::encode(hash)));
                }
            }
        }
        Ok(())
    }
}

/// Adds to `report` why checkpoint `m` cannot be restored whole, if it cannot.
fn check_manifest(
    m: &Manifest,
    locations: &HashMap<ChunkHash, Vec<ChunkLoc>>,
    bad_packs: &BadPacks,
    bad_chunks: &HashMap<ChunkHash, String>,
    report: &mut CheckReport,
) {
    let refs = m.files.iter().flat_map(|f| &f.chunks).chain(m.memory.iter().flat_map(|i| &i.chunks));
    let mut missing = HashSet::new();
    for chunk in refs.filter(|c: &&ChunkRef| !c.hash.is_empty()) {
        let Ok(hash) = ChunkHash::try_from(chunk.hash.as_slice()) else {
            report.breaks(&m.id, "its manifest holds a malformed chunk reference".into());
            continue;
        };
        let usable = locations.get(&hash).into_iter().flatten().find(|l| !bad_packs.contains_key(&*l.pack));
        match (usable, locations.get(&hash)) {
            (Some(loc), _) if loc.part(chunk).is_none() => report.breaks(
                &m.id,
                format!(
                    "a reference to chunk {} takes bytes {}..{} of its {}",
                    hex::encode(hash),
                    chunk.offset,
                    u64::from(chunk.offset) + u64::from(chunk.len),
                    loc.len
                ),
            ),
            (Some(_), _) if !bad_chunks.contains_key(&hash) => {}
            (Some(_), _) => report.breaks(&m.id, bad_chunks[&hash].clone()),
            (None, Some(locs)) => {
                let pack = &locs[0].pack;
                report.breaks(&m.id, format!("pack {pack}, which holds its chunks, {}", bad_packs[&**pack]));
            }
            (None, None) => {
                missing.insert(hash);
            }
        }
    }
    if !missing.is_empty() {
        report.problems.push(format!(
            "checkpoint {} references {} chunks no pack holds",
            m.id,
            missing.len()
        ));
        report.breaks(&m.id, format!("{} of its chunks are in no pack", missing.len()));
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::test_checkpoints::{packs, seeded};

    async fn checkpoint(store: &Store, dir: &std::path::Path, id: &str, seed: u8) {
        crate::test_checkpoints::checkpoint(store, dir, id, "", &seeded(seed, 64)).await;
    }

    #[tokio::test(flavor = "multi_thread")]
    async fn damage_is_found_and_named_with_the_checkpoints_it_breaks() {
        let dir = tempfile::tempdir().unwrap();
        let store = Store::in_dir(&dir.path().join("store"));
        let (a, b) = ("20261123-000001-aaaaaa", "20261123-000002-bbbbbb");
        checkpoint(&store, dir.path(), a, 3).await;
        checkpoint(&store, dir.path(), b, 5).await;
        let clean = store.check(true).await.unwrap();
        assert!(clean.problems.is_empty() && clean.broken.is_empty(), "{clean:?}");
        assert_eq!((clean.manifests, clean.packs), (2, 2));
        assert!(clean.chunks_read > 0);
        assert_eq!(clean.chunks_by_codec.values().sum::<u64>(), clean.chunks_read, "{clean:?}");
        assert!(clean.chunks_by_codec["zstd"] > 0, "the seeded memory compresses: {clean:?}");

        // A flipped byte: the sizes still add up, only reading the data finds it.
        let [first, _] = &packs(dir.path(), ".pack")[..] else { panic!("two packs") };
        let mut data = std::fs::read(first).unwrap();
        data[100] ^= 0xff;
        std::fs::write(first, &data).unwrap();
        assert!(store.check(false).await.unwrap().problems.is_empty());
        let found = store.check(true).await.unwrap();
        assert!(found.problems.iter().any(|p| p.contains("is corrupt")), "{found:?}");
        assert_eq!(found.broken.len(), 1, "only the checkpoint whose chunk it was: {found:?}");
        let hit = found.broken.keys().next().unwrap().clone();
        let other = if hit == a { b } else { a };

        // Truncated: found without reading the data.
        std::fs::write(first, &data[..data.len() / 2]).unwrap();
        let found = store.check(false).await.unwrap();
        assert!(found.problems.iter().any(|p| p.contains("truncated")), "{found:?}");
        assert!(found.broken[&hit].iter().any(|r| r.contains("truncated")), "{found:?}");

        // The other pack's index gone: its chunks are in no pack (and the pack is a leftover).
        let first_index = first.with_extension("idx");
        let other_index = packs(dir.path(), ".idx").into_iter().find(|p| *p != first_index).unwrap();
        std::fs::remove_file(other_index).unwrap();
        let found = store.check(false).await.unwrap();
        assert!(found.broken[other].iter().any(|r| r.contains("in no pack")), "{found:?}");
        assert!(found.notes.iter().any(|n| n.contains("has no index")), "{found:?}");
        assert_eq!(found.broken.len(), 2);
    }
}
