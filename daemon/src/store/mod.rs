//! Where checkpoints live: an `object_store` backend (local directory, S3, GCS, Azure) under a
//! key prefix.
//!
//! ```text
//! <prefix>/checkpoints/<id>/<image file>   CRIU image files of checkpoint <id>
//! <prefix>/manifests/<id>.manifest         written last: the checkpoint exists once it does
//! ```
//!
//! A checkpoint is uploaded file by file and becomes visible only when its manifest is
//! written, so a crash mid-upload leaves no half checkpoint behind, only unreferenced objects
//! that [`Store::remove_uncommitted`] deletes.

mod backend;
mod images;
pub mod manifest;

use std::sync::Arc;

use futures::TryStreamExt;
use object_store::path::Path as ObjPath;
use object_store::{ObjectStore, PutPayload};
use tracing::warn;

pub use backend::OpenStoreError;
pub use images::Progress;
pub use manifest::{Manifest, ManifestError};
pub use stasis_proto::stasis::v1::ImageFile;

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
    #[error("manifest of checkpoint {id} is unreadable")]
    Manifest {
        id: String,
        #[source]
        source: ManifestError,
    },
    #[error("image file {file} of checkpoint {id} is corrupted: {reason}")]
    Corrupt { id: String, file: String, reason: String },
    #[error("local file {path} could not be read or written")]
    Local {
        path: String,
        #[source]
        source: std::io::Error,
    },
}

/// A checkpoint store.
#[derive(Debug, Clone)]
pub struct Store {
    backend: Arc<dyn ObjectStore>,
    prefix: ObjPath,
    url: String,
}

impl Store {
    /// Opens the store at `url` (`file:///dir`, `s3://bucket/prefix`, `gs://…`, `az://…`).
    pub fn open(url: &str) -> Result<Self, OpenStoreError> {
        let (backend, prefix) = backend::open(url)?;
        Ok(Self { backend, prefix, url: url.into() })
    }

    pub fn url(&self) -> &str {
        &self.url
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

    /// Writes the manifest: the step that makes the checkpoint exist.
    pub async fn commit(&self, manifest: &Manifest) -> Result<(), StoreError> {
        let key = self.manifest_key(&manifest.id);
        let payload = PutPayload::from(manifest::encode(manifest));
        self.backend.put(&key, payload).await.map_err(Self::backend_err(&key))?;
        Ok(())
    }

    /// Reads and verifies the manifest of checkpoint `id`.
    pub async fn manifest(&self, id: &str) -> Result<Manifest, StoreError> {
        let key = self.manifest_key(id);
        let data = match self.backend.get(&key).await {
            Ok(r) => r.bytes().await.map_err(Self::backend_err(&key))?,
            Err(object_store::Error::NotFound { .. }) => {
                return Err(StoreError::NotFound(id.into()));
            }
            Err(source) => {
                return Err(StoreError::Backend { key: key.to_string(), source });
            }
        };
        let m = manifest::decode(&data).map_err(|source| StoreError::Manifest { id: id.into(), source })?;
        if m.id != id {
            return Err(StoreError::Manifest {
                id: id.into(),
                source: ManifestError::Decode(format!("manifest names checkpoint {}", m.id)),
            });
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
        let mut out = Vec::new();
        for id in self.checkpoint_ids().await? {
            match self.manifest(&id).await {
                Ok(m) => out.push(m),
                Err(e) => warn!(checkpoint = %id, error = %e, "skipping unreadable manifest"),
            }
        }
        Ok(out)
    }

    /// Deletes checkpoint `id`: the manifest first (it stops existing at once), then its data.
    pub async fn delete(&self, id: &str) -> Result<(), StoreError> {
        let key = self.manifest_key(id);
        match self.backend.delete(&key).await {
            Ok(()) => {}
            Err(object_store::Error::NotFound { .. }) => {
                return Err(StoreError::NotFound(id.into()));
            }
            Err(source) => {
                return Err(StoreError::Backend { key: key.to_string(), source });
            }
        }
        self.remove_uncommitted(id).await
    }

    /// Deletes the data objects of a checkpoint that has no manifest (an interrupted upload).
    pub async fn remove_uncommitted(&self, id: &str) -> Result<(), StoreError> {
        let dir = self.key(&format!("checkpoints/{id}"));
        let metas: Vec<_> =
            self.backend.list(Some(&dir)).try_collect().await.map_err(Self::backend_err(&dir))?;
        for meta in metas {
            match self.backend.delete(&meta.location).await {
                Ok(()) | Err(object_store::Error::NotFound { .. }) => {}
                Err(source) => {
                    return Err(StoreError::Backend { key: meta.location.to_string(), source });
                }
            }
        }
        Ok(())
    }
}
