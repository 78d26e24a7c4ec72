//! Retention and garbage collection: delete old manifests, then reclaim packs no manifest
//! references, and repack packs that are mostly garbage.
//!
//! GC holds the store's lock exclusively, while commits and restores share it, so a chunk
//! that a committing checkpoint has decided to reference is never swept underneath it. Packs
//! written by other nodes (sharing the bucket) may be in flight without a manifest yet, so an
//! unreferenced pack is deleted only once it is older than a grace period, unless it is one of
//! this node's own (its id starts with the node's tag) and the caller asks for those. Between
//! nodes, leases in the store keep a collection and other nodes' commits apart (`lease.rs`).

use std::collections::{BTreeMap, HashMap, HashSet};
use std::sync::Arc;
use std::time::Duration;

use stasis_proto::stasis::store::v1::{Manifest, PackIndex};
use tracing::{info, warn};

use super::assemble::{Verify, decode_chunk};
use super::chunks::FinishedPack;
use super::index::{ChunkHash, ChunkLoc};
use super::{Listing, Store, StoreError, envelope};

/// Packs whose live bytes are below this fraction are rewritten.
const REPACK_BELOW: f64 = 0.5;

/// How many checkpoints to keep per workload.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Retention {
    pub keep_last: usize,
}

#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct GcReport {
    pub manifests_deleted: Vec<String>,
    pub packs_deleted: u64,
    pub packs_repacked: u64,
    pub bytes_freed: u64,
    /// Packs whose index cannot be read, or that a repack found a damaged chunk in: kept, since
    /// they may hold chunks a checkpoint needs (and are the evidence `stasis check` names).
    pub damaged_packs: Vec<String>,
}

/// The packs of a listing of `packs/`, by id: data size, time, whether indexed.
fn pack_objects_of(objects: &[object_store::ObjectMeta]) -> BTreeMap<String, PackObjects> {
    let mut packs: BTreeMap<String, PackObjects> = BTreeMap::new();
    for meta in objects {
        let Some(name) = meta.location.filename() else { continue };
        let (pack, is_data) = match (name.strip_suffix(".pack"), name.strip_suffix(".idx")) {
            (Some(pack), _) => (pack, true),
            (None, Some(pack)) => (pack, false),
            (None, None) => continue,
        };
        let entry = packs.entry(pack.to_string()).or_insert(PackObjects {
            size: None,
            modified: meta.last_modified.into(),
            indexed: false,
        });
        if is_data {
            (entry.size, entry.modified) = (Some(meta.size), meta.last_modified.into());
        } else {
            entry.indexed = true;
        }
    }
    packs
}

/// How long ago `at` was (zero for times in the future).
fn age(at: std::time::SystemTime) -> Duration {
    std::time::SystemTime::now().duration_since(at).unwrap_or_default()
}

impl Store {
    /// The store lease (other nodes) and then the local lock (this node's commits and
    /// restores), in the order `begin_commit` takes them too. Neither is waited for while the
    /// other is held: a collection queued for the local lock would hold up every commit that
    /// comes after it (the lock serves waiters in order) for as long as a restore under way
    /// holds it, and its store lease would hold up this node's commits meanwhile. So both are
    /// given up, and tried again, until `wait` has passed.
    async fn gc_exclusive(
        &self,
        wait: Duration,
    ) -> Result<(super::lease::Lease, tokio::sync::OwnedRwLockWriteGuard<()>), StoreError> {
        let deadline = tokio::time::Instant::now() + wait;
        loop {
            let left = deadline.saturating_duration_since(tokio::time::Instant::now());
            let lease = self.gc_lease(left).await?;
            if let Ok(exclusive) = self.gc_lock.clone().try_write_owned() {
                return Ok((lease, exclusive));
            }
            drop(lease);
            if tokio::time::Instant::now() >= deadline {
                return Err(StoreError::Busy("checkpoints or restores are under way on this node".into()));
            }
            tokio::time::sleep(super::lease::RETRY_EVERY).await;
        }
    }

    /// Applies `retention` (if any), then reclaims unreferenced packs older than `grace` (or,
    /// with `own_too`, any of this node's), and repacks mostly-dead packs. Other nodes' commits
    /// and restores under way, and this node's, are waited for up to `wait` (see `lease.rs`).
    pub async fn gc(
        &self,
        retention: Option<Retention>,
        grace: Duration,
        own_too: bool,
        wait: Duration,
    ) -> Result<GcReport, StoreError> {
        let (lease, _exclusive) = self.gc_exclusive(wait).await?;
        let mut report = GcReport::default();
        let Listing { mut manifests, unreadable } = self.listing().await?;
        // Chunks only an unreadable manifest references would look unreferenced: a manifest
        // read failing for a moment must not cost its checkpoint its data.
        if let Some((id, why)) = unreadable.first() {
            return Err(StoreError::Unreadable {
                id: id.clone(),
                reason: why.clone(),
                more: unreadable.len() - 1,
            });
        }
        if let Some(r) = retention {
            for id in expired(&manifests, r) {
                self.delete(&id).await?;
                report.manifests_deleted.push(id);
            }
            manifests.retain(|m| !report.manifests_deleted.contains(&m.id));
        }
        let live = live_chunks(&manifests);
        // One listing serves the index and the sweep.
        let known = self.index.packs();
        let listing = self.list_packs().await?;
        self.refresh_index_from(&known, &listing).await?;

        for (pack, PackObjects { size, modified, indexed: has_index }) in pack_objects_of(&listing) {
            let size = size.unwrap_or(0);
            let own = own_too && pack.starts_with(&format!("{}-", self.node_tag));
            let reclaimable = own || age(modified) >= grace;
            if !has_index {
                // An upload that died before its index was written.
                if reclaimable {
                    lease.check()?;
                    self.delete_pack(&pack).await?;
                    report.packs_deleted += 1;
                    report.bytes_freed += size;
                }
                continue;
            }
            let index = match self.read_pack_index(&pack).await {
                Ok(index) => index,
                // Its chunks are unknown, so it may hold live ones: keep it, say so, go on.
                Err(e @ StoreError::Envelope { .. }) => {
                    warn!(pack = %pack, error = %stasis_errors::error_chain(&e), "pack index unreadable; pack kept");
                    report.damaged_packs.push(pack);
                    continue;
                }
                Err(e) => return Err(e),
            };
            let total: u64 = index.entries.iter().map(|e| u64::from(e.stored_len)).sum();
            let live_entries: Vec<_> =
                index.entries.iter().filter(|e| is_live(&live, &e.hash)).cloned().collect();
            let live_bytes: u64 = live_entries.iter().map(|e| u64::from(e.stored_len)).sum();
            if live_entries.is_empty() && reclaimable {
                lease.check()?;
                self.delete_pack(&pack).await?;
                report.packs_deleted += 1;
                report.bytes_freed += size;
            } else if !live_entries.is_empty() && (live_bytes as f64) < REPACK_BELOW * total as f64 {
                lease.check()?;
                if let Some(why) = self.repack(&pack, size, live_entries).await? {
                    warn!(pack = %pack, why, "a pack to repack is damaged; kept as it is");
                    report.damaged_packs.push(pack);
                    continue;
                }
                report.packs_repacked += 1;
                report.bytes_freed += size.saturating_sub(live_bytes);
            }
        }
        info!(?report, "garbage collection done");
        Ok(report)
    }

    /// The packs of the store, by id, from one listing of `packs/`.
    pub(super) async fn pack_objects(&self) -> Result<BTreeMap<String, PackObjects>, StoreError> {
        Ok(pack_objects_of(&self.list_packs().await?))
    }

    pub(super) async fn read_pack_index(&self, pack: &str) -> Result<PackIndex, StoreError> {
        let key = self.pack_index_key(pack);
        let data = self
            .backend
            .get(&key)
            .await
            .map_err(Self::backend_err(&key))?
            .bytes()
            .await
            .map_err(Self::backend_err(&key))?;
        envelope::decode(envelope::PACK_INDEX, &data, self.cipher())
            .map_err(|source| StoreError::Envelope { what: format!("index of pack {pack}"), source })
    }

    /// Removes a pack: from the in-memory index first, then its index object (so nobody
    /// dedups against it any more), then its data.
    async fn delete_pack(&self, pack: &str) -> Result<(), StoreError> {
        self.index.remove_pack(pack);
        for key in [self.pack_index_key(pack), self.pack_key(pack)] {
            match self.backend.delete(&key).await {
                Ok(()) | Err(object_store::Error::NotFound { .. }) => {}
                Err(source) => return Err(StoreError::Backend { key: key.to_string(), source }),
            }
        }
        Ok(())
    }

    /// Copies the live chunks of `pack` (`size` bytes long) into a new pack, then deletes the
    /// old one. Each is checked first, as a restore checks it: the copy would carry a damaged
    /// chunk under a fresh name and drop the pack `stasis check` names as damaged, so a pack
    /// cut short or a chunk that does not check out leaves the pack as it is, and why is
    /// returned.
    async fn repack(
        &self,
        pack: &str,
        size: u64,
        live: Vec<stasis_proto::stasis::store::v1::PackEntry>,
    ) -> Result<Option<String>, StoreError> {
        let key = self.pack_key(pack);
        let needed = super::index::reach(&live);
        if needed > size {
            return Ok(Some(format!("it is truncated: {size} bytes stored, live chunks extend to {needed}")));
        }
        let ranges: Vec<_> = live.iter().map(|e| e.offset..e.offset + u64::from(e.stored_len)).collect();
        let blobs = self.backend.get_ranges(&key, &ranges).await.map_err(Self::backend_err(&key))?;
        let id: Arc<str> = pack.into();
        for (entry, blob) in live.iter().zip(&blobs) {
            let checked = match ChunkLoc::of(&id, entry) {
                Some((hash, loc)) => decode_chunk(blob, &loc, &hash, self.cipher(), Verify::Stored).map(drop),
                None => Err("its index entry is malformed"),
            };
            if let Err(why) = checked {
                return Ok(Some(format!("chunk {} is corrupt: {why}", hex::encode(&entry.hash))));
            }
        }
        let mut fresh = FinishedPack {
            data: Vec::new(),
            index: PackIndex {
                pack: super::chunks::new_pack_id(&self.node_tag),
                entries: Vec::with_capacity(live.len()),
            },
            slot: None,
        };
        for (mut entry, blob) in live.into_iter().zip(blobs) {
            entry.offset = fresh.data.len() as u64;
            fresh.data.extend_from_slice(&blob);
            fresh.index.entries.push(entry);
        }
        // The old pack leaves the in-memory index first, so the new locations take effect.
        self.index.remove_pack(pack);
        self.upload_pack(fresh).await?;
        self.delete_pack(pack).await.map(|()| None)
    }
}

/// A pack's objects as the store lists them.
#[derive(Debug, Clone)]
pub(super) struct PackObjects {
    /// Size of its data object; `None` when only its index exists.
    pub size: Option<u64>,
    /// When its data object (else its index) was written.
    pub modified: std::time::SystemTime,
    /// Whether its index exists.
    pub indexed: bool,
}

/// Checkpoints beyond the newest `keep_last` of each workload.
fn expired(manifests: &[Manifest], retention: Retention) -> Vec<String> {
    let mut by_workload: HashMap<&str, Vec<&Manifest>> = HashMap::new();
    for m in manifests {
        by_workload.entry(&m.workload).or_default().push(m);
    }
    let mut out = Vec::new();
    for mut list in by_workload.into_values() {
        list.sort_by(|a, b| (b.created_unix_ms, &b.id).cmp(&(a.created_unix_ms, &a.id)));
        // Whatever else the workload has, its newest checkpoint stasis can restore stays.
        let newest_restorable = list.iter().find(|m| restorable(m)).map(|m| m.id.as_str());
        let old = list.iter().skip(retention.keep_last).filter(|m| Some(m.id.as_str()) != newest_restorable);
        out.extend(old.map(|m| m.id.clone()));
    }
    out.sort();
    out
}

/// Whether stasis can restore `m`: its own checkpoints and Podman's archives can be; another
/// runtime's imported archive (CRI-O's, containerd's) only goes back to that runtime.
fn restorable(m: &Manifest) -> bool {
    m.archive.as_ref().is_none_or(|a| matches!(a.engine.as_str(), "stasis" | "podman"))
}

fn live_chunks(manifests: &[Manifest]) -> HashSet<ChunkHash> {
    let refs = manifests
        .iter()
        .flat_map(|m| m.files.iter().flat_map(|f| &f.chunks).chain(m.memory.iter().flat_map(|i| &i.chunks)));
    refs.filter_map(|c| ChunkHash::try_from(c.hash.as_slice()).ok()).collect()
}

fn is_live(live: &HashSet<ChunkHash>, hash: &[u8]) -> bool {
    ChunkHash::try_from(hash).is_ok_and(|h| live.contains(&h))
}

#[cfg(test)]
mod tests {
    use std::path::PathBuf;

    use super::*;

    fn m(id: &str, workload: &str, at: u64) -> Manifest {
        Manifest { id: id.into(), workload: workload.into(), created_unix_ms: at, ..Default::default() }
    }

    #[test]
    fn retention_never_drops_the_newest_restorable_checkpoint_for_unrestorable_ones() {
        let import = |id: &str, at: u64| Manifest {
            archive: Some(stasis_proto::stasis::store::v1::ArchiveInfo {
                engine: "cri-o".into(),
                ..Default::default()
            }),
            ..m(id, "w", at)
        };
        let all = [m("real1", "w", 1), m("real2", "w", 2), import("x3", 3), import("x4", 4), import("x5", 5)];
        assert_eq!(expired(&all, Retention { keep_last: 3 }), vec!["real1"]);
        assert_eq!(expired(&all, Retention { keep_last: 1 }), vec!["real1", "x3", "x4"]);
    }

    #[test]
    fn retention_keeps_the_newest_per_workload() {
        let all = [m("a1", "a", 1), m("a2", "a", 2), m("a3", "a", 3), m("b1", "b", 1)];
        assert_eq!(expired(&all, Retention { keep_last: 2 }), vec!["a1"]);
        assert_eq!(expired(&all, Retention { keep_last: 1 }), vec!["a1", "a2"]);
        assert!(expired(&all, Retention { keep_last: 3 }).is_empty());
    }

    #[tokio::test]
    async fn a_chunk_in_two_packs_stays_found_when_one_of_them_goes() {
        use stasis_proto::stasis::store::v1::PackEntry;
        let dir = tempfile::tempdir().unwrap();
        let store = Store::in_dir(dir.path());
        let hash = [7u8; 32];
        let pack = |id: &str| FinishedPack {
            data: b"abcd".to_vec(),
            index: PackIndex {
                pack: id.into(),
                entries: vec![PackEntry {
                    hash: hash.to_vec(),
                    offset: 0,
                    stored_len: 4,
                    len: 4,
                    codec: 0,
                    stored_checksum: vec![],
                }],
            },
            slot: None,
        };
        // The chunk's noted home is the first pack; a second holds it too (a repack's copy).
        store.upload_pack(pack("first")).await.unwrap();
        store.upload_pack(pack("second")).await.unwrap();
        // Another node's collection deletes the first.
        for key in [store.pack_index_key("first"), store.pack_key("first")] {
            store.backend.delete(&key).await.unwrap();
        }
        store.refresh_index().await.unwrap();
        let chunk = ChunkHash::try_from(hash.as_slice()).unwrap();
        let found = store.index.get(&chunk).map(|loc| loc.pack.to_string());
        assert_eq!(found.as_deref(), Some("second"), "the chunk is still known, in the pack that holds it");
    }

    /// Two checkpoints of one workload sharing their first 64 KiB chunk; the older one
    /// dropped by retention leaves its pack a quarter live: repacked, unless the live chunk
    /// was damaged first (`damage` gets the older pack's bytes and the chunk's offset in them).
    async fn collect_after(
        damage: Option<fn(&mut Vec<u8>, usize)>,
    ) -> (GcReport, tempfile::TempDir, Store, PathBuf) {
        use crate::test_checkpoints::{checkpoint, noise, packs};
        let dir = tempfile::tempdir().unwrap();
        let store = Store::in_dir(&dir.path().join("store"));
        let shared = noise(crate::CHUNK, 1);
        let memory = |seed| [shared.clone(), noise(3 * crate::CHUNK, seed)].concat();
        checkpoint(&store, dir.path(), "20261129-000001-aaaaaa", "w", &memory(2)).await;
        let [older] = <[_; 1]>::try_from(packs(dir.path(), ".pack")).expect("one pack");
        checkpoint(&store, dir.path(), "20261129-000002-bbbbbb", "w", &memory(4)).await;
        if let Some(damage) = damage {
            let id = crate::crypto::chunk_id(None, &shared);
            let index = store.read_pack_index(&older.file_stem().unwrap().to_string_lossy()).await.unwrap();
            let entry = index.entries.iter().find(|e| e.hash == id).expect("the shared chunk");
            let mut data = std::fs::read(&older).unwrap();
            damage(&mut data, entry.offset as usize);
            std::fs::write(&older, &data).unwrap();
        }
        let report =
            store.gc(Some(Retention { keep_last: 1 }), Duration::ZERO, true, Duration::ZERO).await.unwrap();
        assert_eq!(report.manifests_deleted, ["20261129-000001-aaaaaa"]);
        (report, dir, store, older)
    }

    #[tokio::test(flavor = "multi_thread")]
    async fn a_repack_checks_what_it_copies_and_keeps_a_pack_with_a_damaged_chunk() {
        let (report, _dir, store, older) = collect_after(None).await;
        assert_eq!((report.packs_repacked, report.damaged_packs.len()), (1, 0), "{report:?}");
        assert!(!older.exists(), "repacked");
        let checked = store.check(true).await.unwrap();
        assert!(checked.problems.is_empty() && checked.broken.is_empty(), "{checked:?}");

        let flipped: fn(&mut Vec<u8>, usize) = |data, at| data[at + 100] ^= 0xff;
        let cut: fn(&mut Vec<u8>, usize) = |data, at| data.truncate(at + 100);
        for (damage, found) in [(flipped, "is corrupt"), (cut, "truncated")] {
            let (report, _dir, store, older) = collect_after(Some(damage)).await;
            let pack = older.file_stem().unwrap().to_string_lossy().into_owned();
            assert_eq!(report.packs_repacked, 0, "{report:?}");
            assert_eq!(report.damaged_packs, std::slice::from_ref(&pack), "{report:?}");
            assert!(older.exists(), "the pack with the damaged chunk is kept");
            let checked = store.check(true).await.unwrap();
            assert!(checked.problems.iter().any(|p| p.contains(&pack) && p.contains(found)), "{checked:?}");
            assert_eq!(checked.broken.keys().collect::<Vec<_>>(), ["20261129-000002-bbbbbb"], "{checked:?}");
        }
    }
}
