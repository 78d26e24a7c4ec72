//! Which chunks the store holds, and where: the union of the pack index objects, cached in
//! memory and refreshed from the store (other nodes may have added packs).

use std::collections::{HashMap, HashSet};
use std::sync::{Arc, RwLock};

use stasis_proto::stasis::store::v1::{Codec, PackEntry, PackIndex};

pub type ChunkHash = [u8; 32];

/// Where a chunk is stored.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct ChunkLoc {
    pub pack: Arc<str>,
    pub offset: u64,
    pub stored_len: u32,
    pub len: u32,
    pub codec: Codec,
}

impl ChunkLoc {
    /// The chunk an entry of `pack`'s index names, and where it is; `None` for an entry with
    /// a malformed hash or codec.
    pub fn of(pack: &Arc<str>, e: &PackEntry) -> Option<(ChunkHash, ChunkLoc)> {
        let (hash, codec) = (ChunkHash::try_from(e.hash.as_slice()).ok()?, Codec::try_from(e.codec).ok()?);
        Some((
            hash,
            ChunkLoc { pack: pack.clone(), offset: e.offset, stored_len: e.stored_len, len: e.len, codec },
        ))
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

    /// Forgets every pack and chunk.
    pub fn clear(&self) {
        let mut inner = self.write();
        inner.chunks.clear();
        inner.packs.clear();
    }

    /// Forgets a pack and the chunks located in it.
    pub fn remove_pack(&self, pack: &str) {
        let mut inner = self.write();
        inner.chunks.retain(|_, loc| &*loc.pack != pack);
        inner.packs.remove(pack);
    }
}
