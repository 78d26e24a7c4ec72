//! Leases between the nodes that share a store, so that one node's garbage collection never
//! deletes a pack another node is about to reference.
//!
//! A node dedups against every pack it has indexed, so a commit may come to reference a chunk
//! in a pack that no manifest references yet (or any more): exactly the packs a collection
//! deletes. Within a node the store's lock keeps them apart; between nodes, objects under
//! `locks/` do:
//!
//! ```text
//!  commit or restore: write locks/use-<node>-<rand>, then look for a live locks/gc-<n>
//!                     (found: drop ours, wait, try again)
//!  collection:        create locks/gc-<n+1> (create-if-absent: one node wins), then look for
//!                     live use leases (found: wait for them, up to a limit)
//! ```
//!
//! Each side writes its own lease before it looks for the other's, so of two that start at
//! once at least one sees the other. Leases carry an expiry and are renewed while held: a node
//! that dies holding one blocks the others for at most [`TTL`]. A collection lease that has
//! expired is taken over by creating the next generation, never by overwriting it, so two
//! nodes taking over at once cannot both win.

use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant, SystemTime, UNIX_EPOCH};

use futures::TryStreamExt;
use object_store::path::Path as ObjPath;
use object_store::{ObjectStore, PutMode, PutOptions};
use serde::{Deserialize, Serialize};
use tracing::{debug, info, warn};

use super::{Store, StoreError};

/// How long a lease holds unless renewed.
pub const TTL: Duration = Duration::from_secs(120);
/// How often a held lease is renewed.
const RENEW_EVERY: Duration = Duration::from_secs(30);
/// How often a waiting node looks again.
pub(super) const RETRY_EVERY: Duration = Duration::from_millis(500);

#[derive(Debug, Clone, Serialize, Deserialize)]
struct LeaseBody {
    node: String,
    expires_unix_ms: u64,
}

/// A lease held in the store; released (deleted) when dropped, renewed meanwhile.
#[derive(Debug)]
pub struct Lease {
    backend: Arc<dyn ObjectStore>,
    key: ObjPath,
    renewer: Option<tokio::task::JoinHandle<()>>,
    /// Until when the store holds it for sure: its last write plus the TTL, less a margin
    /// for the write's own time and the clocks' drift.
    holds_until: Arc<Mutex<Instant>>,
}

impl Lease {
    /// Fails once the lease may have lapsed (its renewals failed for most of a TTL): another
    /// node may act as if it were gone, so what it protects must not be relied on any more.
    pub fn check(&self) -> Result<(), StoreError> {
        match Instant::now() < *self.holds_until.lock().unwrap_or_else(|p| p.into_inner()) {
            true => Ok(()),
            false => {
                Err(StoreError::Busy(format!("the store lease {} lapsed: its renewals failed", self.key)))
            }
        }
    }
}

/// Taken off a lease's TTL for [`Lease::check`].
const LAPSE_MARGIN: Duration = Duration::from_secs(30);

impl Drop for Lease {
    fn drop(&mut self) {
        let renewer = self.renewer.take();
        renewer.iter().for_each(tokio::task::JoinHandle::abort);
        let (backend, key) = (self.backend.clone(), self.key.clone());
        if let Ok(runtime) = tokio::runtime::Handle::try_current() {
            runtime.spawn(async move {
                // The renewal ended first, so none of its writes comes after the delete.
                if let Some(renewer) = renewer {
                    let _ = renewer.await;
                }
                if let Err(e) = backend.delete(&key).await {
                    warn!(lease = %key, error = %e, "cannot release a store lease; it expires by itself");
                }
            });
        }
    }
}

fn now_ms() -> u64 {
    SystemTime::now().duration_since(UNIX_EPOCH).map_or(0, |d| d.as_millis() as u64)
}

fn body(node: &str) -> bytes::Bytes {
    let body = LeaseBody { node: node.to_owned(), expires_unix_ms: now_ms() + TTL.as_millis() as u64 };
    serde_json::to_vec(&body).expect("a lease serializes").into()
}

impl Store {
    /// A lease for using the store's packs (a commit, a restore): taken once no other node
    /// collects garbage; waits meanwhile.
    pub(super) async fn use_lease(&self) -> Result<Lease, StoreError> {
        let mut waited = false;
        loop {
            let key = self.key(&format!("locks/use-{}-{:08x}", self.node_tag, rand::random::<u32>()));
            let lease = self.write_lease(key, PutMode::Overwrite).await?.expect("overwrite always writes");
            // This node's own collection is ordered by the store's local lock, which a commit
            // takes next: only other nodes' collections are waited for here.
            let others = self.live_leases("gc-").await?.into_iter().find(|(_, b)| b.node != *self.node_tag);
            match others {
                None => return Ok(lease),
                Some((_, holder)) => {
                    drop(lease);
                    if !std::mem::replace(&mut waited, true) {
                        info!(node = %holder.node, "waiting for another node's garbage collection");
                    }
                    tokio::time::sleep(RETRY_EVERY).await;
                }
            }
        }
    }

    /// The collection lease, once no other node uses the store's packs; waits up to `wait`
    /// for them, then fails naming them. Another node's live collection lease fails at once;
    /// this node's own (one just released, or another collection here, which the store's
    /// local lock orders after this one) does not.
    pub(super) async fn gc_lease(&self, wait: Duration) -> Result<Lease, StoreError> {
        let gcs = self.live_or_all_gc().await?;
        if let Some((_, holder, _)) = gcs.iter().find(|(_, b, live)| *live && b.node != *self.node_tag) {
            return Err(StoreError::Busy(format!("node {} is collecting garbage", holder.node)));
        }
        // The expired generations are litter.
        for (n, _, _) in gcs.iter().filter(|(_, _, live)| !live) {
            let _ = self.backend.delete(&self.key(&format!("locks/gc-{n:012}"))).await;
        }
        let mut next = gcs.iter().map(|(n, _, _)| n + 1).max().unwrap_or(0);
        let deadline = tokio::time::Instant::now() + wait;
        loop {
            let key = self.key(&format!("locks/gc-{next:012}"));
            let Some(lease) = self.write_lease(key, PutMode::Create).await? else {
                return Err(StoreError::Busy("another node began collecting garbage".into()));
            };
            let users: Vec<String> = self
                .live_leases("use-")
                .await?
                .into_iter()
                .filter(|(_, b)| b.node != *self.node_tag)
                .map(|(_, b)| b.node)
                .collect();
            if users.is_empty() {
                return Ok(lease);
            }
            // Not held while waiting: other nodes' commits (an eviction racing a deadline, say)
            // must not queue behind a collection that has not begun.
            drop(lease);
            if tokio::time::Instant::now() >= deadline {
                return Err(StoreError::Busy(format!(
                    "checkpoints or restores are under way on node(s) {}",
                    users.join(", ")
                )));
            }
            debug!(nodes = ?users, "garbage collection waits for other nodes' commits");
            tokio::time::sleep(RETRY_EVERY).await;
            next += 1;
        }
    }

    /// Removes the leases this node holds in the store: at start, they are a previous run's,
    /// which died holding them (a collection's would hold up this node's commits until it
    /// expired).
    pub async fn clear_own_leases(&self) -> Result<usize, StoreError> {
        let mut cleared = 0;
        for (name, lease) in self.leases("").await? {
            if lease.node == *self.node_tag {
                let key = self.key(&format!("locks/{name}"));
                self.backend.delete(&key).await.map_err(Self::backend_err(&key))?;
                cleared += 1;
            }
        }
        Ok(cleared)
    }

    /// Writes a lease at `key` (with `mode`) and starts renewing it; `None` if `Create` found
    /// the key taken.
    async fn write_lease(&self, key: ObjPath, mode: PutMode) -> Result<Option<Lease>, StoreError> {
        let options = PutOptions { mode, ..Default::default() };
        match self.backend.put_opts(&key, body(&self.node_tag).into(), options).await {
            Ok(_) => {}
            Err(object_store::Error::AlreadyExists { .. }) => return Ok(None),
            Err(source) => return Err(StoreError::Lease { key: key.to_string(), source }),
        }
        let holds_until = Arc::new(Mutex::new(Instant::now() + TTL - LAPSE_MARGIN));
        let (backend, renewed, node) = (self.backend.clone(), key.clone(), self.node_tag.clone());
        let until = holds_until.clone();
        let renewer = tokio::spawn(async move {
            loop {
                tokio::time::sleep(RENEW_EVERY).await;
                let at = Instant::now();
                match backend.put(&renewed, body(&node).into()).await {
                    Ok(_) => *until.lock().unwrap_or_else(|p| p.into_inner()) = at + TTL - LAPSE_MARGIN,
                    Err(e) => warn!(lease = %renewed, error = %e, "cannot renew a store lease"),
                }
            }
        });
        Ok(Some(Lease { backend: self.backend.clone(), key, renewer: Some(renewer), holds_until }))
    }

    /// The unexpired leases whose names start with `kind`, by name.
    async fn live_leases(&self, kind: &str) -> Result<Vec<(String, LeaseBody)>, StoreError> {
        let now = now_ms();
        Ok(self.leases(kind).await?.into_iter().filter(|(_, b)| b.expires_unix_ms > now).collect())
    }

    /// Every collection lease: (generation, body, whether live).
    async fn live_or_all_gc(&self) -> Result<Vec<(u64, LeaseBody, bool)>, StoreError> {
        let now = now_ms();
        let gcs = self.leases("gc-").await?.into_iter();
        Ok(gcs
            .filter_map(|(name, b)| {
                let live = b.expires_unix_ms > now;
                Some((name.strip_prefix("gc-")?.parse().ok()?, b, live))
            })
            .collect())
    }

    /// The leases whose names start with `kind`; unreadable ones (a lease being deleted, or
    /// garbage) are skipped.
    async fn leases(&self, kind: &str) -> Result<Vec<(String, LeaseBody)>, StoreError> {
        let dir = self.key("locks");
        let metas: Vec<_> =
            self.backend.list(Some(&dir)).try_collect().await.map_err(Self::backend_err(&dir))?;
        let mut found = Vec::new();
        for meta in metas {
            let Some(name) = meta.location.filename().filter(|n| n.starts_with(kind)).map(str::to_owned)
            else {
                continue;
            };
            let Ok(read) = self.backend.get(&meta.location).await else { continue };
            let Ok(data) = read.bytes().await else { continue };
            if let Ok(lease) = serde_json::from_slice::<LeaseBody>(&data) {
                found.push((name, lease));
            }
        }
        Ok(found)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Two nodes' views of one store in `dir`.
    fn nodes(dir: &std::path::Path) -> (Store, Store) {
        let open = |tag: &str| Store::in_dir(dir).with_node_tag(tag);
        (open("node-a"), open("node-b"))
    }

    #[tokio::test]
    async fn a_collection_waits_for_another_nodes_commit_and_then_runs() {
        let dir = tempfile::tempdir().unwrap();
        let (a, b) = nodes(dir.path());
        let commit = a.begin_commit().await.unwrap();
        let busy = b.gc(None, Duration::ZERO, false, Duration::from_millis(600)).await.unwrap_err();
        assert!(
            busy.to_string().contains("checkpoints or restores are under way on node(s) node-a"),
            "{busy}"
        );
        // Waiting long enough, it runs once the commit is done.
        let release = tokio::spawn(async move {
            tokio::time::sleep(Duration::from_millis(700)).await;
            drop(commit);
        });
        b.gc(None, Duration::ZERO, false, Duration::from_secs(10)).await.unwrap();
        release.await.unwrap();
        // Its own commits never hold up a node's collection (its store lock orders them).
        let _own = b.begin_commit().await.unwrap();
        drop(_own);
        b.gc(None, Duration::ZERO, false, Duration::ZERO).await.unwrap();
    }

    #[tokio::test]
    async fn a_long_restore_never_holds_up_this_nodes_commits_through_a_waiting_collection() {
        let dir = tempfile::tempdir().unwrap();
        let (a, _) = nodes(dir.path());
        // A restore under way (minutes, for a lazy one) holds a commit guard.
        let restoring = a.begin_commit().await.unwrap();
        let collector = a.clone();
        let collection =
            tokio::spawn(
                async move { collector.gc(None, Duration::ZERO, false, Duration::from_secs(3)).await },
            );
        tokio::time::sleep(Duration::from_millis(300)).await;
        // An eviction's commit meanwhile goes ahead at once.
        let commit = tokio::time::timeout(Duration::from_secs(2), a.begin_commit()).await;
        assert!(commit.is_ok(), "a commit waited behind a collection that waits for a restore");
        drop(commit);
        let busy = collection.await.unwrap().unwrap_err();
        assert!(busy.to_string().contains("under way on this node"), "{busy}");
        // Once the restore is done, a collection runs.
        drop(restoring);
        a.gc(None, Duration::ZERO, false, Duration::from_secs(3)).await.unwrap();
    }

    #[tokio::test]
    async fn a_commit_waits_for_another_nodes_collection() {
        let dir = tempfile::tempdir().unwrap();
        let (a, b) = nodes(dir.path());
        let collecting = a.gc_lease(Duration::ZERO).await.unwrap();
        let waiting = tokio::spawn(async move { b.begin_commit().await.map(drop) });
        tokio::time::sleep(Duration::from_millis(800)).await;
        assert!(!waiting.is_finished(), "a commit went ahead during another node's collection");
        // Nor may a second collection start.
        let busy = a.clone().with_node_tag("node-c").gc_lease(Duration::ZERO).await.unwrap_err();
        assert!(busy.to_string().contains("node node-a is collecting garbage"), "{busy}");
        drop(collecting);
        tokio::time::timeout(Duration::from_secs(10), waiting).await.unwrap().unwrap().unwrap();
    }

    #[tokio::test]
    async fn a_dead_nodes_lease_expires_and_is_taken_over() {
        let dir = tempfile::tempdir().unwrap();
        let (a, b) = nodes(dir.path());
        // What a node that died while collecting leaves: a lease past its expiry.
        let stale = LeaseBody { node: "node-a".into(), expires_unix_ms: now_ms() - 1 };
        let key = a.key("locks/gc-000000000007");
        a.backend.put(&key, serde_json::to_vec(&stale).unwrap().into()).await.unwrap();
        let taken = b.gc_lease(Duration::ZERO).await.unwrap();
        assert_eq!(taken.key, b.key("locks/gc-000000000008"));
        assert!(a.backend.head(&key).await.is_err(), "the expired generation is cleared away");
        drop(taken);
        tokio::time::timeout(Duration::from_secs(10), a.begin_commit()).await.unwrap().unwrap();
    }

    #[tokio::test]
    async fn a_restarted_node_clears_the_leases_its_previous_run_left() {
        let dir = tempfile::tempdir().unwrap();
        let (a, b) = nodes(dir.path());
        // A run that died: its leases stay behind (not dropped, so not released).
        std::mem::forget(a.begin_commit().await.unwrap());
        std::mem::forget(a.gc_lease(Duration::ZERO).await.unwrap());
        assert_eq!(a.clear_own_leases().await.unwrap(), 2);
        let _others = b.use_lease().await.unwrap();
        assert_eq!(a.clear_own_leases().await.unwrap(), 0, "b's lease is not a's to clear");
        assert!(b.live_leases("gc-").await.unwrap().is_empty());
        assert_eq!(b.live_leases("use-").await.unwrap().len(), 1);
    }

    #[tokio::test]
    async fn a_commit_whose_lease_lapsed_is_refused() {
        let dir = tempfile::tempdir().unwrap();
        let (a, _) = nodes(dir.path());
        let guard = a.begin_commit().await.unwrap();
        let manifest = stasis_proto::stasis::store::v1::Manifest {
            id: "20261123-000000-abcdef".into(),
            ..Default::default()
        };
        // Renewals that kept failing for most of a TTL.
        *guard.lease.holds_until.lock().unwrap() = Instant::now() - Duration::from_secs(1);
        let err = a.commit(&manifest, &guard).await.unwrap_err();
        assert!(err.to_string().contains("lapsed"), "{err}");
        assert!(a.manifest(&manifest.id).await.is_err(), "nothing was committed");
    }
}
