//! Where checkpoints live: an `object_store` backend (local directory, S3, GCS, Azure) under a
//! key prefix, content-addressed and deduplicated.
//!
//! ```text
//! <prefix>/packs/<pack>.pack           chunk bytes (zstd, lz4 or raw), ~32 MiB per pack
//! <prefix>/packs/<pack>.idx            which chunks the pack holds (written after the pack)
//! <prefix>/manifests/<id>.manifest     written last: the checkpoint exists once it does
//! ```
//!
//! A checkpoint's memory and image files are cut into chunks (64 KiB, at aligned addresses);
//! all-zero chunks are never stored, and chunks the store already holds are referenced, not
//! uploaded, so a checkpoint costs what changed. Every manifest lists all chunks it needs:
//! any checkpoint restores by itself, and deleting one never breaks another. Unreferenced
//! packs are reclaimed by [`Store::gc`]. Dedup never crosses store prefixes (tenants).

#![deny(unsafe_code)]

mod assemble;
mod backend;
mod check;
mod chunks;
mod codec;
mod cow;
mod credentials;
pub mod crypto;
mod deadline;
pub mod envelope;
mod gc;
mod image_check;
mod image_runs;
mod index;
mod lazy_memory;
#[cfg(test)]
mod lazy_memory_tests;
mod lease;
mod memory;
mod pack_slots;
mod parent;
mod prefetch;
mod read_back;
mod sift;
mod staging;
mod stream;
#[cfg(test)]
mod test_checkpoints;
mod tree_pages;
mod upload;

use std::sync::Arc;

use futures::TryStreamExt;
use object_store::path::Path as ObjPath;
use object_store::{ObjectStore, PutPayload};
use tracing::warn;

pub use assemble::MemoryMode;
pub use backend::OpenStoreError;
pub use check::CheckReport;
pub use chunks::{CHUNK, ChunkStats};
pub use codec::Compression;
pub use envelope::EnvelopeError;
pub use gc::{GcReport, Retention};
pub use lazy_memory::LazyMemory;
pub use parent::{Parent, ParentError, ParentMemory};
pub use prefetch::{
    Ask, ChunkData, ChunkReader, FetchSettings, LazyFetch, LazyFetchError, PREFETCH_BYTES, Placer,
};
pub use sift::{Sifted, Sifting};
pub use staging::{Staged, Staging, StagingBudget};
pub use stasis_proto::stasis::store::v1::{Manifest, PodInfo};
pub use stream::{BlockPool, StreamSink, StreamSource, stream};
pub use tree_pages::TreeMemory;
pub use upload::{DumpPages, StoredDump};

use index::{ChunkHash, ChunkIndex};
use stasis_proto::stasis::store::v1::ChunkRef;

/// A progress callback: `(bytes done, bytes in total)`.
pub type Progress = Arc<dyn Fn(u64, u64) + Send + Sync>;

/// A store operation failed.
#[derive(Debug, thiserror::Error)]
pub enum StoreError {
    #[error("checkpoint {0} not found in the store")]
    NotFound(String),
    #[error("store operation on {key} failed")]
    Backend {
        key: String,
        #[source]
        source: object_store::Error,
    },
    #[error(
        "cannot write lease {key}: the store must be writable, for restores and wakes too (their \
         lease keeps other nodes' garbage collection off the packs they read)"
    )]
    Lease {
        key: String,
        #[source]
        source: object_store::Error,
    },
    #[error("{what} is unreadable")]
    Envelope {
        what: String,
        #[source]
        source: EnvelopeError,
    },
    #[error("checkpoint {id} is corrupted: {file}: {reason}")]
    Corrupt { id: String, file: String, reason: String },
    #[error("checkpoint {id} needs chunk {chunk}, which is in no pack of the store")]
    MissingChunk { id: String, chunk: String },
    #[error("checkpoint {id} needs pack {pack}, which is missing from the store")]
    MissingPack { id: String, pack: String },
    #[error("chunk {chunk} of checkpoint {id} (pack {pack}) is corrupted: {reason}")]
    CorruptChunk { id: String, chunk: String, pack: String, reason: String },
    #[error(
        "garbage collection stopped: the manifest of checkpoint {id} cannot be read ({reason}){}, \
         and the chunks only it references would look unreferenced; repair or delete it, then \
         collect again",
        if *.more > 0 { format!(" nor those of {more} other checkpoint(s)") } else { String::new() }
    )]
    Unreadable { id: String, reason: String, more: usize },
    #[error("the store is busy: {0}; try again later")]
    Busy(String),
    /// A dump's images lack one that another refers to: CRIU's restore of it would fail.
    #[error("the dump's images are not a set CRIU can restore")]
    Images(#[source] stasis_criu_images::image_set::ImageSetError),
    /// A dump stored while CRIU sent it ended before all its pages came (the dump failed).
    #[error("the dump ended before all its pages arrived")]
    DumpUnfinished,
    /// A dump tracking dirty pages could not take its unchanged pages from the previous
    /// checkpoint.
    #[error("the dump's unchanged pages could not be taken from the previous checkpoint")]
    Parent(#[source] parent::ParentError),
    #[error("local file {path} could not be read or written")]
    Local {
        path: String,
        #[source]
        source: std::io::Error,
    },
}

impl StoreError {
    /// An error naming the local file `path` that could not be read or written.
    pub(crate) fn local(path: &std::path::Path) -> impl Fn(std::io::Error) -> Self + use<> {
        let path = path.display().to_string();
        move |source| Self::Local { path: path.clone(), source }
    }
}

/// A checkpoint store.
#[derive(Debug, Clone)]
pub struct Store {
    backend: Arc<dyn ObjectStore>,
    prefix: ObjPath,
    url: String,
    index: Arc<ChunkIndex>,
    /// Commits (which reference chunks) share it; garbage collection takes it alone, so a
    /// chunk a committing checkpoint relies on is never swept underneath it.
    gc_lock: Arc<tokio::sync::RwLock<()>>,
    /// Prefix of the ids of packs this node writes.
    node_tag: Arc<str>,
    /// An encrypted store's cipher (see `crypto.rs`).
    cipher: Option<Arc<crypto::Cipher>>,
    /// Places for packs in memory, shared by every checkpoint being stored.
    pack_slots: pack_slots::PackSlots,
    /// Places for fetched packs, shared by every restore.
    fetch_slots: Arc<tokio::sync::Semaphore>,
    /// Whether a range read lands in a buffer of its own (see [`backend::Opened`]).
    reads_apart: bool,
    /// How the chunks this store writes are compressed.
    compression: Compression,
}

/// Held while a checkpoint decides which chunks to reference and commits its manifest (or a
/// restore reads them): keeps this node's garbage collection out, and, by its lease, other
/// nodes' (see `lease.rs`).
#[derive(Debug)]
pub struct CommitGuard {
    _local: tokio::sync::OwnedRwLockReadGuard<()>,
    lease: lease::Lease,
}

/// The checkpoints of a store: the readable manifests and the ids that could not be read.
#[derive(Debug, Default)]
pub struct Listing {
    pub manifests: Vec<Manifest>,
    /// (checkpoint id, why its manifest could not be read)
    pub unreadable: Vec<(String, String)>,
}

#[cfg(any(test, feature = "testing"))]
impl Store {
    /// A file store in `dir`, for tests.
    pub fn in_dir(dir: &std::path::Path) -> Store {
        Store::open(&format!("file://{}", dir.display()), std::time::Duration::from_secs(1)).unwrap()
    }
}

impl Store {
    /// Opens the store at `url` (`file:///dir`, `s3://bucket/prefix`, `gs://…`, `az://…`);
    /// each request to a remote store, retries included, ends within `retry_timeout`.
    pub fn open(url: &str, retry_timeout: std::time::Duration) -> Result<Self, OpenStoreError> {
        let backend::Opened { backend, prefix, reads_apart } = backend::open(url, retry_timeout)?;
        Ok(Self { url: url.into(), reads_apart, ..Self::from_backend(backend, prefix) })
    }

    /// A store of the objects under `prefix` in `backend`, named by them: how unit tests put
    /// a store of their own (in memory, failing on cue) under the engine.
    pub fn from_backend(backend: Arc<dyn ObjectStore>, prefix: ObjPath) -> Self {
        Self {
            url: format!("{backend}/{prefix}"),
            backend,
            prefix,
            index: Default::default(),
            gc_lock: Default::default(),
            node_tag: "local".into(),
            cipher: None,
            pack_slots: Default::default(),
            fetch_slots: Arc::new(tokio::sync::Semaphore::new(assemble::FETCHES_IN_MEMORY)),
            reads_apart: false,
            compression: Compression::default(),
        }
    }

    /// Names the packs this store writes `<tag>-<random>`; the tag identifies this node.
    pub fn with_node_tag(mut self, tag: &str) -> Self {
        self.node_tag = tag.into();
        self
    }

    /// Compresses the chunks this store writes as `compression` says (zstd by default); the
    /// chunks already stored are read as they were written.
    pub fn with_compression(mut self, compression: Compression) -> Self {
        self.compression = compression;
        self
    }

    /// How the chunks this store writes are compressed.
    pub fn compression(&self) -> Compression {
        self.compression
    }

    /// This node's tag (its host name and state directory, hashed): it prefixes the node's
    /// pack names, and names its daemon's cgroups.
    pub fn node_tag(&self) -> &str {
        &self.node_tag
    }

    pub fn url(&self) -> &str {
        &self.url
    }

    /// Opens an encrypted store with `key` (its `keys` object made, in an empty store), or
    /// checks that an unencrypted one is used without a key. With `rotate_from` (the old key),
    /// the data key is first re-wrapped under `key`.
    pub async fn unlock(
        mut self,
        key: Option<&crypto::StoreKey>,
        rotate_from: Option<&crypto::StoreKey>,
    ) -> Result<Self, OpenStoreError> {
        let url = self.url.clone();
        let keys_key = self.key(crypto::KEYS_OBJECT);
        let keys_err = |source| OpenStoreError::Keys { url: url.clone(), source };
        let key_err = |source| OpenStoreError::Key { url: url.clone(), source };
        let existing = match self.backend.get(&keys_key).await {
            Ok(r) => Some(r.bytes().await.map_err(keys_err)?),
            Err(object_store::Error::NotFound { .. }) => None,
            Err(source) => return Err(keys_err(source)),
        };
        let cipher = match (existing, key) {
            (None, None) => return Ok(self),
            (Some(_), None) => return Err(OpenStoreError::NeedsKey(url)),
            (Some(object), Some(key)) => {
                let object = match rotate_from {
                    Some(old) => {
                        let rotated = old.rewrap(&object, key).map_err(key_err)?;
                        self.backend.put(&keys_key, rotated.clone().into()).await.map_err(keys_err)?;
                        tracing::info!(store = %url, "store key rotated");
                        rotated.into()
                    }
                    None => object,
                };
                key.open_keys(&object).map_err(key_err)?
            }
            (None, Some(key)) => {
                let holds = |dir: &str| {
                    let dir = self.key(dir);
                    let backend = self.backend.clone();
                    async move { backend.list(Some(&dir)).try_next().await.map(|first| first.is_some()) }
                };
                if holds("manifests").await.map_err(keys_err)? || holds("packs").await.map_err(keys_err)? {
                    return Err(OpenStoreError::NotEncrypted(url));
                }
                let (object, cipher) = key.new_keys_object();
                let create =
                    object_store::PutOptions { mode: object_store::PutMode::Create, ..Default::default() };
                match self.backend.put_opts(&keys_key, object.into(), create).await {
                    Ok(_) => cipher,
                    // Another node made them first: use theirs.
                    Err(object_store::Error::AlreadyExists { .. }) => {
                        let object = self
                            .backend
                            .get(&keys_key)
                            .await
                            .map_err(keys_err)?
                            .bytes()
                            .await
                            .map_err(keys_err)?;
                        key.open_keys(&object).map_err(key_err)?
                    }
                    Err(source) => return Err(keys_err(source)),
                }
            }
        };
        self.cipher = Some(Arc::new(cipher));
        Ok(self)
    }

    /// The cipher of an encrypted store.
    pub(crate) fn cipher(&self) -> Option<&crypto::Cipher> {
        self.cipher.as_deref()
    }

    fn key(&self, rel: &str) -> ObjPath {
        rel.split('/').fold(self.prefix.clone(), |p, part| p.child(part))
    }

    fn manifest_key(&self, id: &str) -> ObjPath {
        self.key(&format!("manifests/{id}.manifest"))
    }

    fn backend_err(key: &ObjPath) -> impl FnOnce(object_store::Error) -> StoreError + '_ {
        move |source| StoreError::Backend { key: key.to_string(), source }
    }

    /// Starts a commit: keeps garbage collection (this node's and others') out until the
    /// guard is dropped, and brings the chunk index up to date, so that the commit dedups only
    /// against packs that exist (and, under the lease, stay).
    ///
    /// The store lease comes first, the local lock second, as in a collection: a commit never
    /// waits for another node while holding what this node's collection waits for.
    pub async fn begin_commit(&self) -> Result<CommitGuard, StoreError> {
        let lease = self.use_lease().await?;
        // The index is brought up to date under the local lock: a refresh while this node's
        // collection moves chunks between packs could note a chunk's old pack as its home, and
        // forget it once that pack is deleted.
        let local = self.gc_lock.clone().read_owned().await;
        self.refresh_index().await?;
        Ok(CommitGuard { _local: local, lease })
    }

    /// Loads the indexes of packs this store has not seen yet (written by other nodes, or
    /// before a restart), and forgets those no longer there (another node's collection
    /// deleted them): nothing may be deduplicated against a pack that is gone.
    pub async fn refresh_index(&self) -> Result<(), StoreError> {
        let known = self.index.packs();
        self.refresh_index_from(&known, &self.list_packs().await?).await
    }

    /// The objects under `packs/`.
    async fn list_packs(&self) -> Result<Vec<object_store::ObjectMeta>, StoreError> {
        let dir = self.key("packs");
        self.backend.list(Some(&dir)).try_collect().await.map_err(Self::backend_err(&dir))
    }

    /// [`Store::refresh_index`] from a listing of `packs/` already made, `known` being the
    /// packs the index knew before it was made (one uploaded since is not in it, and not gone).
    async fn refresh_index_from(
        &self,
        known: &[Arc<str>],
        metas: &[object_store::ObjectMeta],
    ) -> Result<(), StoreError> {
        let listed: std::collections::HashSet<&str> =
            metas.iter().filter_map(|m| m.location.filename()?.strip_suffix(".idx")).collect();
        if known.iter().any(|p| !listed.contains(&**p)) {
            // A chunk may be in several packs (a repack copies it, two commits may each store
            // it) and the index keeps one of its locations: when a pack goes, the chunks it
            // was the noted home of are still in others, so every pack is read again, into an
            // index aside that then takes the place of this one (restores and dumps under way
            // keep looking chunks up meanwhile).
            let fresh = ChunkIndex::default();
            self.read_pack_indexes(metas, &fresh).await?;
            self.index.replace(fresh, known);
            return Ok(());
        }
        self.read_pack_indexes(metas, &self.index).await
    }

    /// Adds to `index` the pack indexes listed in `metas` that it does not know yet.
    async fn read_pack_indexes(
        &self,
        metas: &[object_store::ObjectMeta],
        index: &ChunkIndex,
    ) -> Result<(), StoreError> {
        for meta in metas {
            let Some(pack) = meta.location.filename().and_then(|f| f.strip_suffix(".idx")) else { continue };
            if index.knows_pack(pack) {
                continue;
            }
            let data = match self.backend.get(&meta.location).await {
                Ok(r) => r.bytes().await.map_err(Self::backend_err(&meta.location))?,
                // Removed by a concurrent garbage collection.
                Err(object_store::Error::NotFound { .. }) => continue,
                Err(source) => return Err(StoreError::Backend { key: meta.location.to_string(), source }),
            };
            match envelope::decode(envelope::PACK_INDEX, &data, self.cipher()) {
                Ok(pack_index) => index.add(&pack_index),
                Err(e) => warn!(pack, error = %e, "skipping unreadable pack index"),
            }
        }
        Ok(())
    }

    /// Writes the manifest: the step that makes the checkpoint exist. Refused if the commit's
    /// lease lapsed: another node's collection may have taken packs it references.
    pub async fn commit(&self, manifest: &Manifest, guard: &CommitGuard) -> Result<(), StoreError> {
        guard.lease.check()?;
        let key = self.manifest_key(&manifest.id);
        // Format 1.1 only where needed: older readers refuse it, and take the rest as before.
        let parts = manifest.memory.iter().flat_map(|i| &i.chunks).any(|c| self.takes_part(c));
        let minor = if parts { envelope::MANIFEST_WITH_PARTS } else { 0 };
        let manifest = envelope::encode_as(envelope::MANIFEST, minor, manifest, self.cipher());
        let payload = PutPayload::from(manifest);
        self.backend.put(&key, payload).await.map_err(Self::backend_err(&key))?;
        Ok(())
    }

    /// Whether chunk reference `chunk` takes a part of its chunk rather than all of it, as far
    /// as the chunk index knows the chunk.
    fn takes_part(&self, chunk: &ChunkRef) -> bool {
        let stored = ChunkHash::try_from(chunk.hash.as_slice()).ok().and_then(|h| self.index.get(&h));
        chunk.offset != 0 || stored.is_some_and(|loc| loc.len != chunk.len)
    }

    /// Reads and verifies the manifest of checkpoint `id`.
    pub async fn manifest(&self, id: &str) -> Result<Manifest, StoreError> {
        let key = self.manifest_key(id);
        let data = match self.backend.get(&key).await {
            Ok(r) => r.bytes().await.map_err(Self::backend_err(&key))?,
            Err(object_store::Error::NotFound { .. }) => return Err(StoreError::NotFound(id.into())),
            Err(source) => return Err(StoreError::Backend { key: key.to_string(), source }),
        };
        let what = || format!("manifest of checkpoint {id}");
        let m: Manifest = envelope::decode(envelope::MANIFEST, &data, self.cipher())
            .map_err(|source| StoreError::Envelope { what: what(), source })?;
        if m.id != id {
            let source = EnvelopeError::Decode(format!("it names checkpoint {}", m.id));
            return Err(StoreError::Envelope { what: what(), source });
        }
        Ok(m)
    }

    /// The ids of all committed checkpoints, oldest first.
    pub async fn checkpoint_ids(&self) -> Result<Vec<String>, StoreError> {
        let dir = self.key("manifests");
        let metas: Vec<_> =
            self.backend.list(Some(&dir)).try_collect().await.map_err(Self::backend_err(&dir))?;
        let mut ids: Vec<String> = metas
            .iter()
            .filter_map(|m| m.location.filename()?.strip_suffix(".manifest").map(str::to_string))
            .collect();
        ids.sort();
        Ok(ids)
    }

    /// All readable manifests, oldest first. Unreadable ones are logged and left out.
    pub async fn manifests(&self) -> Result<Vec<Manifest>, StoreError> {
        Ok(self.listing().await?.manifests)
    }

    /// All manifests, oldest first, and the checkpoints whose manifest could not be read (with
    /// why): a caller that decides what is garbage must not take those for absent.
    pub async fn listing(&self) -> Result<Listing, StoreError> {
        let mut listing = Listing::default();
        for id in self.checkpoint_ids().await? {
            match self.manifest(&id).await {
                Ok(m) => listing.manifests.push(m),
                Err(e) => {
                    warn!(checkpoint = %id, error = %e, "unreadable manifest");
                    listing.unreadable.push((id, stasis_errors::error_chain(&e)));
                }
            }
        }
        // Ids sort by second only; within a second the creation time orders them.
        listing.manifests.sort_by(|a, b| (a.created_unix_ms, &a.id).cmp(&(b.created_unix_ms, &b.id)));
        Ok(listing)
    }

    /// Deletes checkpoint `id` (its manifest). Its chunks stay until garbage collection finds
    /// no other checkpoint referencing them.
    pub async fn delete(&self, id: &str) -> Result<(), StoreError> {
        let key = self.manifest_key(id);
        match self.backend.delete(&key).await {
            Ok(()) => Ok(()),
            Err(object_store::Error::NotFound { .. }) => Err(StoreError::NotFound(id.into())),
            Err(source) => Err(StoreError::Backend { key: key.to_string(), source }),
        }
    }
}
