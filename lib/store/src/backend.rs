//! Choosing an `object_store` backend from a store URL.

use std::path::Path;
use std::sync::Arc;
use std::time::Duration;

use object_store::aws::AmazonS3Builder;
use object_store::azure::MicrosoftAzureBuilder;
use object_store::gcp::GoogleCloudStorageBuilder;
use object_store::local::LocalFileSystem;
use object_store::memory::InMemory;
use object_store::path::Path as ObjPath;
use object_store::{BackoffConfig, ObjectStore, RetryConfig};
use url::Url;

use super::credentials;
use stasis_linux::cloud::Cloud;

/// A store URL could not be turned into a backend.
#[derive(Debug, thiserror::Error)]
pub enum OpenStoreError {
    #[error("invalid store URL {url:?}")]
    BadUrl {
        url: String,
        #[source]
        source: url::ParseError,
    },
    #[error("store URL {0:?} has an unsupported scheme (use file://, s3://, gs://, az:// or memory://)")]
    UnsupportedScheme(String),
    #[error("cannot use the store at {url}: {why}")]
    NoCredentials { url: String, why: String },
    #[error("the local store directory {path} cannot be made stasisd's alone")]
    LocalDir {
        path: String,
        #[source]
        source: std::io::Error,
    },
    #[error("the store at {0} is encrypted: give its key (--store-key-file or STASIS_STORE_KEY)")]
    NeedsKey(String),
    #[error("the store at {0} holds unencrypted checkpoints: an encrypted store needs a location of its own")]
    NotEncrypted(String),
    #[error("the key for the store at {url} does not fit")]
    Key {
        url: String,
        #[source]
        source: super::crypto::KeyError,
    },
    #[error("cannot read or write the keys of the store at {url}")]
    Keys {
        url: String,
        #[source]
        source: object_store::Error,
    },
    #[error("cannot configure the store backend for {url}")]
    Backend {
        url: String,
        #[source]
        source: object_store::Error,
    },
}

/// How a failing request to a remote store is retried: with back-off, while less than three
/// quarters of `bound` has passed since it began, so that a refusing store's own error (a 503,
/// a reset) ends it before the [`Deadline`] around the backend cuts it at `bound`, as it cuts
/// a hung one. A checkpoint that evicts its tree keeps it stopped while storing: a dead store
/// must fail in bounded time.
///
/// A pause between tries is at most an eighth of `bound`: an error seen just before three
/// quarters of it is followed by one last try, whose own error then ends the request before
/// the deadline. With object_store's default (pauses growing to 15 s) that try came after the
/// deadline, which then hid the store's error behind a time-out.
fn retry_config(bound: Duration) -> RetryConfig {
    let backoff = BackoffConfig { max_backoff: bound / 8, ..Default::default() };
    RetryConfig { max_retries: usize::MAX, retry_timeout: bound * 3 / 4, backoff }
}

/// `backend` with each request (retries included) ended at `bound`.
fn bounded(backend: Arc<dyn ObjectStore>, bound: Duration) -> Arc<dyn ObjectStore> {
    Arc::new(super::deadline::Deadline::new(backend, bound))
}

/// A backend opened for a store URL.
pub struct Opened {
    pub backend: Arc<dyn ObjectStore>,
    /// The key prefix all objects go under.
    pub prefix: ObjPath,
    /// Whether each range read lands in a buffer of its own (a local directory's reads):
    /// remote backends hand out slices of downloads that merged nearby ranges, or of a
    /// connection's read buffer.
    pub reads_apart: bool,
}

/// Opens the backend for `url`.
///
/// S3, GCS and Azure take credentials and settings from the standard environment variables
/// (`AWS_ACCESS_KEY_ID`, `AWS_ENDPOINT` for S3-compatible servers, `AWS_ALLOW_HTTP`, ...).
pub fn open(url: &str, bound: Duration) -> Result<Opened, OpenStoreError> {
    let retry = retry_config(bound);
    let parsed = Url::parse(url).map_err(|source| OpenStoreError::BadUrl { url: url.into(), source })?;
    let backend_err = |source| OpenStoreError::Backend { url: url.into(), source };
    let prefix = || ObjPath::from(parsed.path().trim_matches('/'));
    match parsed.scheme() {
        "file" => {
            let dir = parsed.path();
            stasis_linux::private_dir::ensure_private_dir(Path::new(dir))
                .map_err(|source| OpenStoreError::LocalDir { path: dir.into(), source })?;
            let fs = LocalFileSystem::new_with_prefix(dir).map_err(backend_err)?;
            Ok(Opened { backend: Arc::new(fs), prefix: ObjPath::default(), reads_apart: true })
        }
        "memory" => Ok(Opened { backend: Arc::new(InMemory::new()), prefix: prefix(), reads_apart: false }),
        scheme => {
            let Some(cloud) = credentials::cloud_of(scheme) else {
                return Err(OpenStoreError::UnsupportedScheme(scheme.into()));
            };
            let home = std::env::var_os("HOME").map(std::path::PathBuf::from);
            let env = |name: &str| std::env::var(name).ok();
            if let Some(why) = credentials::missing(cloud, env, home.as_deref(), Cloud::detect()) {
                return Err(OpenStoreError::NoCredentials { url: url.into(), why });
            }
            let backend: Arc<dyn ObjectStore> = match cloud {
                Cloud::Aws => Arc::new(
                    AmazonS3Builder::from_env()
                        .with_url(url)
                        .with_retry(retry)
                        .build()
                        .map_err(backend_err)?,
                ),
                Cloud::Gcp => Arc::new(
                    GoogleCloudStorageBuilder::from_env()
                        .with_url(url)
                        .with_retry(retry)
                        .build()
                        .map_err(backend_err)?,
                ),
                Cloud::Azure => Arc::new(
                    MicrosoftAzureBuilder::from_env()
                        .with_url(url)
                        .with_retry(retry)
                        .build()
                        .map_err(backend_err)?,
                ),
            };
            Ok(Opened { backend: bounded(backend, bound), prefix: prefix(), reads_apart: false })
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn retry() -> Duration {
        Duration::from_secs(1)
    }

    #[test]
    fn the_last_try_of_a_refused_request_comes_before_the_deadline() {
        for secs in [1, 2, 5, 30] {
            let bound = Duration::from_secs(secs);
            let retry = retry_config(bound);
            // The last error that allows another try, the longest pause, and room for that try.
            let last_try = retry.retry_timeout + retry.backoff.max_backoff;
            assert!(last_try + bound / 8 <= bound, "{bound:?}: the last try starts at {last_try:?}");
            assert!(retry.backoff.init_backoff <= retry.backoff.max_backoff, "{bound:?}");
        }
    }

    #[test]
    fn schemes() {
        let dir = tempfile::tempdir().unwrap();
        let url = format!("file://{}/store", dir.path().display());
        assert!(open(&url, retry()).unwrap().reads_apart, "a local store's range reads are its own");
        assert!(dir.path().join("store").is_dir());
        // Schemes are case-insensitive.
        assert!(open(&url.replacen("file", "FILE", 1), retry()).unwrap().reads_apart);
        assert!(matches!(open("ftp://x/y", retry()), Err(OpenStoreError::UnsupportedScheme(_))));
        assert!(matches!(open("not a url", retry()), Err(OpenStoreError::BadUrl { .. })));
        let memory = open("memory:///tenant/a", retry()).unwrap();
        assert_eq!(memory.prefix.as_ref(), "tenant/a");
        assert!(!memory.reads_apart, "in memory, range reads are slices of the object");
    }
}
