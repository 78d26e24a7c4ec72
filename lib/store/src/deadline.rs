//! One time bound for every request to a remote store: `--store-retry-secs` covers a request
//! and all its retries together, whether the store refuses (503s, resets: retried with
//! back-off until the bound) or hangs (an attempt that never answers is cut at the bound).
//! Without it a refusing store failed after ten quick retries (~6 s) and a hung one cost the
//! HTTP client's 30 s per request, so an eviction could hold its tree stopped for minutes.
//!
//! [`Deadline`] wraps the backend and bounds each call; a read is bounded until its last byte
//! (it is read into memory within the bound), a listing per page, a multipart upload per part
//! and for its completion or abort.

use std::fmt;
use std::ops::Range;
use std::sync::Arc;
use std::time::Duration;

use bytes::Bytes;
use futures::stream::{BoxStream, StreamExt};
use object_store::path::Path;
use object_store::{
    GetOptions, GetResult, GetResultPayload, ListResult, MultipartUpload, ObjectMeta, ObjectStore,
    PutMultipartOptions, PutOptions, PutPayload, PutResult, Result, UploadPart,
};

/// A backend whose every call ends within `bound`.
pub struct Deadline {
    inner: Arc<dyn ObjectStore>,
    bound: Duration,
}

impl Deadline {
    pub fn new(inner: Arc<dyn ObjectStore>, bound: Duration) -> Deadline {
        Deadline { inner, bound }
    }
}

/// `future`'s result, or a timeout error once `bound` has passed.
async fn within<T>(bound: Duration, future: impl Future<Output = Result<T>>) -> Result<T> {
    tokio::time::timeout(bound, future).await.unwrap_or_else(|_| Err(timed_out(bound)))
}

/// The error of a call that did not end within `bound`.
fn timed_out(bound: Duration) -> object_store::Error {
    object_store::Error::Generic {
        store: "stasis",
        source: format!(
            "no answer within {} s, retries included: timed out (--store-retry-secs bounds each store request)",
            bound.as_secs_f64()
        )
        .into(),
    }
}

impl fmt::Display for Deadline {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "{} (each request within {:?})", self.inner, self.bound)
    }
}

impl fmt::Debug for Deadline {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        fmt::Display::fmt(self, f)
    }
}

#[async_trait::async_trait]
impl ObjectStore for Deadline {
    async fn put_opts(&self, location: &Path, payload: PutPayload, opts: PutOptions) -> Result<PutResult> {
        within(self.bound, self.inner.put_opts(location, payload, opts)).await
    }

    async fn put_multipart_opts(
        &self,
        location: &Path,
        opts: PutMultipartOptions,
    ) -> Result<Box<dyn MultipartUpload>> {
        let inner = within(self.bound, self.inner.put_multipart_opts(location, opts)).await?;
        Ok(Box::new(BoundedUpload { inner, bound: self.bound }))
    }

    async fn get_opts(&self, location: &Path, options: GetOptions) -> Result<GetResult> {
        within(self.bound, async {
            let got = self.inner.get_opts(location, options).await?;
            let (meta, range, attributes) = (got.meta.clone(), got.range.clone(), got.attributes.clone());
            let bytes = got.bytes().await?;
            let payload = GetResultPayload::Stream(futures::stream::once(async { Ok(bytes) }).boxed());
            Ok(GetResult { payload, meta, range, attributes })
        })
        .await
    }

    async fn get_ranges(&self, location: &Path, ranges: &[Range<u64>]) -> Result<Vec<Bytes>> {
        within(self.bound, self.inner.get_ranges(location, ranges)).await
    }

    async fn head(&self, location: &Path) -> Result<ObjectMeta> {
        within(self.bound, self.inner.head(location)).await
    }

    async fn delete(&self, location: &Path) -> Result<()> {
        within(self.bound, self.inner.delete(location)).await
    }

    fn list(&self, prefix: Option<&Path>) -> BoxStream<'static, Result<ObjectMeta>> {
        let bound = self.bound;
        futures::stream::unfold(Some(self.inner.list(prefix)), move |stream| async move {
            let mut stream = stream?;
            match tokio::time::timeout(bound, stream.next()).await {
                Ok(Some(item)) => Some((item, Some(stream))),
                Ok(None) => None,
                Err(_) => Some((Err(timed_out(bound)), None)),
            }
        })
        .boxed()
    }

    async fn list_with_delimiter(&self, prefix: Option<&Path>) -> Result<ListResult> {
        within(self.bound, self.inner.list_with_delimiter(prefix)).await
    }

    async fn copy(&self, from: &Path, to: &Path) -> Result<()> {
        within(self.bound, self.inner.copy(from, to)).await
    }

    async fn copy_if_not_exists(&self, from: &Path, to: &Path) -> Result<()> {
        within(self.bound, self.inner.copy_if_not_exists(from, to)).await
    }
}

/// A multipart upload whose every part, and its completion or abort, ends within `bound`.
#[derive(Debug)]
struct BoundedUpload {
    inner: Box<dyn MultipartUpload>,
    bound: Duration,
}

#[async_trait::async_trait]
impl MultipartUpload for BoundedUpload {
    fn put_part(&mut self, data: PutPayload) -> UploadPart {
        let (part, bound) = (self.inner.put_part(data), self.bound);
        Box::pin(within(bound, part))
    }

    async fn complete(&mut self) -> Result<PutResult> {
        within(self.bound, self.inner.complete()).await
    }

    async fn abort(&mut self) -> Result<()> {
        within(self.bound, self.inner.abort()).await
    }
}

#[cfg(test)]
mod tests {
    use object_store::memory::InMemory;

    use super::*;

    /// A store whose every call hangs.
    #[derive(Debug)]
    struct Hung;

    impl fmt::Display for Hung {
        fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
            f.write_str("hung")
        }
    }

    #[async_trait::async_trait]
    impl ObjectStore for Hung {
        async fn put_opts(&self, _: &Path, _: PutPayload, _: PutOptions) -> Result<PutResult> {
            std::future::pending().await
        }
        async fn put_multipart_opts(
            &self,
            _: &Path,
            _: PutMultipartOptions,
        ) -> Result<Box<dyn MultipartUpload>> {
            std::future::pending().await
        }
        async fn get_opts(&self, _: &Path, _: GetOptions) -> Result<GetResult> {
            std::future::pending().await
        }
        async fn delete(&self, _: &Path) -> Result<()> {
            std::future::pending().await
        }
        fn list(&self, _: Option<&Path>) -> BoxStream<'static, Result<ObjectMeta>> {
            futures::stream::pending().boxed()
        }
        async fn list_with_delimiter(&self, _: Option<&Path>) -> Result<ListResult> {
            std::future::pending().await
        }
        async fn copy(&self, _: &Path, _: &Path) -> Result<()> {
            std::future::pending().await
        }
        async fn copy_if_not_exists(&self, _: &Path, _: &Path) -> Result<()> {
            std::future::pending().await
        }
    }

    #[tokio::test(start_paused = true)]
    async fn a_hung_store_fails_each_call_at_the_bound() {
        let store = Deadline::new(Arc::new(Hung), Duration::from_secs(2));
        let key = Path::from("manifests/x");
        let started = tokio::time::Instant::now();
        let err = store.put(&key, Bytes::from_static(b"m").into()).await.unwrap_err();
        assert_eq!(started.elapsed(), Duration::from_secs(2));
        assert!(err.to_string().contains("no answer within 2 s, retries included: timed out"), "{err}");
        assert!(store.get(&key).await.is_err());
        let listed = store.list(None).next().await.unwrap().unwrap_err();
        assert!(
            listed.to_string().contains("no answer within 2 s"),
            "a listing names the bound too: {listed}"
        );
        assert!(store.put_multipart(&key).await.is_err());
        assert_eq!(started.elapsed(), Duration::from_secs(8));
    }

    #[tokio::test]
    async fn a_store_that_answers_is_passed_through() {
        let store = Deadline::new(Arc::new(InMemory::new()), Duration::from_secs(2));
        let key = Path::from("packs/a.pack");
        let mut upload = store.put_multipart(&key).await.unwrap();
        upload.put_part(Bytes::from_static(b"hello ").into()).await.unwrap();
        upload.put_part(Bytes::from_static(b"world").into()).await.unwrap();
        upload.complete().await.unwrap();
        assert_eq!(store.get(&key).await.unwrap().bytes().await.unwrap(), Bytes::from_static(b"hello world"));
        assert_eq!(store.get_range(&key, 6..11).await.unwrap(), Bytes::from_static(b"world"));
        assert_eq!(store.list(None).collect::<Vec<_>>().await.len(), 1);
    }
}
