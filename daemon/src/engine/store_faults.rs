//! The checkpoint job's failure paths around the store, on the fakes of `rollback_tests` and
//! an in-memory store that fails on cue ([`FaultyStore`]): a write refused part-way through
//! the upload, or the commit refused, leaves the workload running and nothing listed.

use std::fmt;
use std::sync::Arc;
use std::sync::atomic::{AtomicUsize, Ordering};

use futures::stream::BoxStream;
use nix::sys::signal::Signal;
use object_store::memory::InMemory;
use object_store::path::Path;
use object_store::{
    GetOptions, GetResult, ListResult, MultipartUpload, ObjectMeta, ObjectStore, PutMultipartOptions,
    PutOptions, PutPayload, PutResult, Result,
};

use super::CheckpointError;
use super::rollback_tests::{CHILD, Extras, ROOT, Rig, rig_with};
use crate::criu::fake::FakeCriu;
use crate::cuda::fake::FakeGpu;
use crate::store::Store;

/// The prefix the tests' stores keep their objects under.
const PREFIX: &str = "stasis";

/// A store in memory whose `nth` write (a put or the start of a multipart upload, counted from
/// 1) under `under` fails; every other call is the in-memory store's.
#[derive(Debug)]
struct FaultyStore {
    inner: InMemory,
    under: Path,
    nth: usize,
    /// Writes under `under` so far.
    writes: AtomicUsize,
}

impl FaultyStore {
    /// A store failing the `nth` write under `<PREFIX>/<under>`.
    fn failing(under: &str, nth: usize) -> Arc<FaultyStore> {
        let under = Path::from(format!("{PREFIX}/{under}"));
        Arc::new(FaultyStore { inner: InMemory::new(), under, nth, writes: AtomicUsize::new(0) })
    }

    /// The error of a write to `location`, if it is the one to fail.
    fn fault(&self, location: &Path) -> Result<()> {
        if !location.prefix_matches(&self.under) {
            return Ok(());
        }
        if self.writes.fetch_add(1, Ordering::SeqCst) + 1 == self.nth {
            let source = format!("injected failure of write {} under {}", self.nth, self.under).into();
            return Err(object_store::Error::Generic { store: "faulty", source });
        }
        Ok(())
    }

    /// The objects stored under `<PREFIX>/<under>`.
    async fn stored(&self, under: &str) -> usize {
        use futures::TryStreamExt;
        let prefix = Path::from(format!("{PREFIX}/{under}"));
        self.inner.list(Some(&prefix)).try_collect::<Vec<_>>().await.unwrap().len()
    }
}

impl fmt::Display for FaultyStore {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "faulty {} (write {} under {} fails)", self.inner, self.nth, self.under)
    }
}

#[async_trait::async_trait]
impl ObjectStore for FaultyStore {
    async fn put_opts(&self, location: &Path, payload: PutPayload, opts: PutOptions) -> Result<PutResult> {
        self.fault(location)?;
        self.inner.put_opts(location, payload, opts).await
    }

    async fn put_multipart_opts(
        &self,
        location: &Path,
        opts: PutMultipartOptions,
    ) -> Result<Box<dyn MultipartUpload>> {
        self.fault(location)?;
        self.inner.put_multipart_opts(location, opts).await
    }

    async fn get_opts(&self, location: &Path, options: GetOptions) -> Result<GetResult> {
        self.inner.get_opts(location, options).await
    }

    async fn delete(&self, location: &Path) -> Result<()> {
        self.inner.delete(location).await
    }

    fn list(&self, prefix: Option<&Path>) -> BoxStream<'static, Result<ObjectMeta>> {
        self.inner.list(prefix)
    }

    async fn list_with_delimiter(&self, prefix: Option<&Path>) -> Result<ListResult> {
        self.inner.list_with_delimiter(prefix).await
    }

    async fn copy(&self, from: &Path, to: &Path) -> Result<()> {
        self.inner.copy(from, to).await
    }

    async fn copy_if_not_exists(&self, from: &Path, to: &Path) -> Result<()> {
        self.inner.copy_if_not_exists(from, to).await
    }
}

/// The rig of `rollback_tests` on `store`.
fn rig_on(store: &Arc<FaultyStore>) -> Rig {
    let store = Store::from_backend(store.clone(), Path::from(PREFIX));
    rig_with(FakeCriu::default(), FakeGpu::default(), Extras { store: Some(store), ..Default::default() })
}

/// What an eviction whose storing failed must leave: the tree given back as it was (what
/// CRIU stopped continued, its connections out of repair mode, its CUDA state back), nothing
/// killed, nothing listed.
async fn assert_given_back(r: &Rig, err: &CheckpointError) {
    assert!(matches!(err, CheckpointError::Store { .. }), "{err}");
    assert!(crate::error_chain(err).contains("injected failure"), "{}", crate::error_chain(err));
    assert_eq!(r.host.signals_of(Signal::SIGCONT), [ROOT], "{CHILD} was stopped before and stays so");
    assert!(r.host.signals_of(Signal::SIGKILL).is_empty());
    assert_eq!(*r.host.repairs.lock().unwrap(), 1);
    assert_eq!(r.gpu.calls().last().map(String::as_str), Some(format!("unlock {ROOT}").as_str()));
    assert_eq!(r.checkpoints().await, 0);
}

#[tokio::test]
async fn an_eviction_whose_first_pack_write_fails_gives_the_tree_back() {
    let store = FaultyStore::failing("packs", 1);
    let r = rig_on(&store);
    let err = r.checkpoint(false).await.unwrap_err();
    assert_given_back(&r, &err).await;
    assert_eq!(store.stored("manifests").await, 0, "nothing committed");
}

#[tokio::test]
async fn an_eviction_whose_commit_fails_gives_the_tree_back() {
    let store = FaultyStore::failing("manifests", 1);
    let r = rig_on(&store);
    let err = r.checkpoint(false).await.unwrap_err();
    assert_given_back(&r, &err).await;
    assert!(crate::error_chain(&err).contains("manifests"), "{}", crate::error_chain(&err));
    assert_eq!(store.stored("manifests").await, 0);
}

#[tokio::test]
async fn a_store_that_fails_only_a_later_write_lets_the_first_checkpoint_through() {
    // The first checkpoint's commit is the first write under manifests/; the second's fails.
    let store = FaultyStore::failing("manifests", 2);
    let r = rig_on(&store);
    let first = r.checkpoint(true).await.unwrap();
    assert!(first.durable && first.left_running);
    let err = r.checkpoint(false).await.unwrap_err();
    assert!(matches!(err, CheckpointError::Store { .. }), "{err}");
    assert!(r.host.signals_of(Signal::SIGKILL).is_empty(), "the workload runs on");
    assert_eq!(r.checkpoints().await, 1, "only the first is listed");
}

#[tokio::test]
async fn a_later_checkpoint_left_running_whose_commit_fails_leaves_the_tree_running() {
    // The second checkpoint of the workload is sifted as CRIU sends it (the first staged every
    // page); its commit, the second write under manifests/, fails; the third goes through.
    let store = FaultyStore::failing("manifests", 2);
    let r = rig_on(&store);
    r.checkpoint(true).await.unwrap();
    let err = r.checkpoint(true).await.unwrap_err();
    assert!(matches!(err, CheckpointError::Store { .. }), "{err}");
    assert!(crate::error_chain(&err).contains("injected failure"), "{}", crate::error_chain(&err));
    assert!(r.host.signals_of(Signal::SIGKILL).is_empty(), "the workload runs on");
    assert_eq!(r.checkpoints().await, 1, "only the first is listed");
    let third = r.checkpoint(true).await.unwrap();
    assert!(third.durable && third.left_running);
    assert_eq!(r.checkpoints().await, 2);
}
