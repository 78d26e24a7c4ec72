//! Which chunks the store holds, and where: the union of the pack index objects, cached in
//! memory and refreshed from the store (other nodes may have added packs).

use std::collections::{HashMap, HashSet};
use std::sync::{Arc, RwLock};

use stasis_proto::stasis::store::v1::{ChunkRef, Codec, PackEntry, PackIndex};

pub type ChunkHash = [u8; 32];

/// What a pack index records of a chunk's stored bytes to find damage to them: their XXH3-128
/// (`PackEntry.stored_checksum`). Not a defence against someone who can write the store: in a
/// store without a key they could rewrite the index and the manifests too, and in one with a
/// key every chunk is sealed, which is.
pub type StoredChecksum = [u8; 16];

/// The [`StoredChecksum`] of `stored`, a chunk's bytes as a pack holds them.
pub fn stored_checksum(stored: &[u8]) -> StoredChecksum {
    xxhash_rust::xxh3::xxh3_128(stored).to_le_bytes()
}

/// How long a pack must be for `entries` of its index: the end of the furthest.
pub fn reach(entries: &[PackEntry]) -> u64 {
    entries.iter().map(|e| e.offset + u64::from(e.stored_len)).max().unwrap_or(0)
}

/// Where a chunk is stored.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct ChunkLoc {
    pub pack: Arc<str>,
    pub offset: u64,
    pub stored_len: u32,
    pub len: u32,
    pub codec: Codec,
    /// The checksum of the chunk's stored bytes, where the index records one.
    pub stored_checksum: Option<StoredChecksum>,
}

impl ChunkLoc {
    /// Which of this chunk's bytes `chunk` references: all of them for a whole chunk, a part
    /// from its offset for one that takes part of it; `None` if it reaches past them.
    pub fn part(&self, chunk: &ChunkRef) -> Option<std::ops::Range<usize>> {
        let from = chunk.offset as usize;
        let to = from.checked_add(chunk.len as usize)?;
        (to <= self.len as usize).then_some(from..to)
    }

    /// The chunk an entry of `pack`'s index names, and where it is; `None` for an entry with
    /// a malformed hash, codec or checksum.
    pub fn of(pack: &Arc<str>, e: &PackEntry) -> Option<(ChunkHash, ChunkLoc)> {
        let (hash, codec) = (ChunkHash::try_from(e.hash.as_slice()).ok()?, Codec::try_from(e.codec).ok()?);
        let stored_checksum = match e.stored_checksum.as_slice() {
            [] => None,
            recorded => Some(StoredChecksum::try_from(recorded).ok()?),
        };
        let (offset, stored_len, len) = (e.offset, e.stored_len, e.len);
        Some((hash, ChunkLoc { pack: pack.clone(), offset, stored_len, len, codec, stored_checksum }))
    }
}

#[derive(Debug, Default)]
struct Inner {
    chunks: HashMap<ChunkHash, ChunkLoc>,
    packs: HashSet<Arc<str>>,
}

/// The chunk index of a store.
#[derive(Debug, Default)]
pub struct ChunkIndex {
    inner: RwLock<Inner>,
}

impl ChunkIndex {
    fn read(&self) -> std::sync::RwLockReadGuard<'_, Inner> {
        self.inner.read().unwrap_or_else(|p| p.into_inner())
    }

    fn write(&self) -> std::sync::RwLockWriteGuard<'_, Inner> {
        self.inner.write().unwrap_or_else(|p| p.into_inner())
    }

    pub fn contains(&self, hash: &ChunkHash) -> bool {
        self.read().chunks.contains_key(hash)
    }

    pub fn get(&self, hash: &ChunkHash) -> Option<ChunkLoc> {
        self.read().chunks.get(hash).cloned()
    }

    pub fn knows_pack(&self, pack: &str) -> bool {
        self.read().packs.contains(pack)
    }

    /// Adds the chunks of one pack. Entries with a malformed hash or codec are skipped.
    pub fn add(&self, index: &PackIndex) {
        let pack: Arc<str> = index.pack.as_str().into();
        let mut inner = self.write();
        for (hash, loc) in index.entries.iter().filter_map(|e| ChunkLoc::of(&pack, e)) {
            inner.chunks.entry(hash).or_insert(loc);
        }
        inner.packs.insert(pack);
    }

    /// The packs whose chunks it knows.
    pub fn packs(&self) -> Vec<Arc<str>> {
        self.read().packs.iter().cloned().collect()
    }

    /// Takes `fresh`'s packs and chunks in place of its own, in one step (a lookup meanwhile
    /// sees the one or the other, never an index half read), keeping the packs it learned
    /// since `known` was taken (uploads under way) that `fresh` lacks.
    pub fn replace(&self, fresh: ChunkIndex, known: &[Arc<str>]) {
        let mut fresh = fresh.inner.into_inner().unwrap_or_else(|p| p.into_inner());
        let mut inner = self.write();
        let known: HashSet<&str> = known.iter().map(|p| &**p).collect();
        let added: HashSet<Arc<str>> = inner
            .packs
            .iter()
            .filter(|p| !known.contains(&***p) && !fresh.packs.contains(*p))
            .cloned()
            .collect();
        for (hash, loc) in inner.chunks.drain() {
            if added.contains(&loc.pack) {
                fresh.chunks.entry(hash).or_insert(loc);
            }
        }
        fresh.packs.extend(added);
        *inner = fresh;
    }

    /// Forgets a pack and the chunks located in it.
    pub fn remove_pack(&self, pack: &str) {
        let mut inner = self.write();
        inner.chunks.retain(|_, loc| &*loc.pack != pack);
        inner.packs.remove(pack);
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// A pack index naming chunks `hashes` (each hash all one byte).
    fn pack(name: &str, hashes: &[u8]) -> PackIndex {
        let entries = hashes
            .iter()
            .map(|&h| PackEntry {
                hash: vec![h; 32],
                offset: 0,
                stored_len: 1,
                len: 1,
                codec: Codec::Raw as i32,
                stored_checksum: Vec::new(),
            })
            .collect();
        PackIndex { pack: name.into(), entries }
    }

    #[test]
    fn an_entry_whose_checksum_is_not_16_bytes_names_no_chunk() {
        let name: Arc<str> = "p".into();
        let mut entry = pack("p", &[5]).entries.remove(0);
        assert_eq!(ChunkLoc::of(&name, &entry).unwrap().1.stored_checksum, None, "none recorded");
        entry.stored_checksum = vec![6; 16];
        assert_eq!(ChunkLoc::of(&name, &entry).unwrap().1.stored_checksum, Some([6; 16]));
        for len in [1, 15, 17, 32] {
            entry.stored_checksum = vec![6; len];
            assert!(ChunkLoc::of(&name, &entry).is_none(), "{len} bytes");
        }
    }

    #[test]
    fn a_rebuilt_index_replaces_the_old_at_once_and_keeps_packs_uploaded_meanwhile() {
        let index = ChunkIndex::default();
        index.add(&pack("gone", &[1, 2]));
        index.add(&pack("kept", &[2, 3]));
        let known = index.packs();
        // An upload lands while the store is read again.
        index.add(&pack("uploaded", &[4]));
        let fresh = ChunkIndex::default();
        fresh.add(&pack("kept", &[2, 3]));
        index.replace(fresh, &known);
        assert!(!index.contains(&[1; 32]), "the gone pack's only chunk is forgotten");
        assert_eq!(
            index.get(&[2; 32]).map(|l| l.pack),
            Some("kept".into()),
            "a chunk noted in the gone pack is found in another"
        );
        assert!(index.contains(&[3; 32]));
        assert!(index.contains(&[4; 32]), "the pack uploaded meanwhile is still known");
        let mut packs: Vec<String> = index.packs().iter().map(|p| p.to_string()).collect();
        packs.sort();
        assert_eq!(packs, ["kept", "uploaded"]);
    }
}
