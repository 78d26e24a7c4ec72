//! How the engine is set: what it needs to start ([`EngineConfig`]) and how its jobs behave
//! ([`Settings`]), each value once, with its default. stasisd's flags and configuration file
//! are resolved into them (`crate::config`).

use std::path::{Path, PathBuf};
use std::time::Duration;

use super::IdleSettings;
use crate::criu::NetworkLock;
use crate::store::crypto::StoreKey;
use crate::store::{Compression, FetchSettings};

const DEFAULT_STORE: &str = "file:///var/lib/stasis/store";
const DEFAULT_STATE_DIR: &str = "/var/lib/stasis/state";
const DEFAULT_KEEP_LAST: usize = 3;
const DEFAULT_GC_GRACE_SECS: u64 = 3600;
const DEFAULT_STORE_RETRY_SECS: u64 = 30;
const DEFAULT_LAZY_CACHE_MIB: u64 = 1024;
const DEFAULT_LAZY_TIMEOUT_SECS: u64 = 60;
const DEFAULT_NETWORK_LOCK_KEEP_SECS: u64 = 1800;

/// What the engine needs to start, and how it is set.
#[derive(Debug, Clone, PartialEq)]
pub struct EngineConfig {
    pub state_dir: PathBuf,
    pub store_url: String,
    pub criu_path: PathBuf,
    /// Bytes of dumped pages held in memory before spilling to disk (`None`: RAM / 4).
    pub staging_limit: Option<u64>,
    /// How the chunks of new checkpoints are compressed.
    pub compression: Compression,
    /// How long requests to a remote store are retried before they fail.
    pub store_retry: Duration,
    /// The network lock to use; `None` picks one (see [`crate::criu::support::choose_network_lock`]).
    pub network_lock: Option<NetworkLock>,
    /// How long the network lock of an eviction is kept for a restore on this node.
    pub network_lock_keep: Duration,
    /// The store's encryption key, and (once, for rotation) the key it was wrapped with.
    pub store_key: Option<StoreKey>,
    pub rotate_store_key_from: Option<StoreKey>,
    /// How its jobs behave; the engine keeps these.
    pub settings: Settings,
}

/// How the engine's jobs behave.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct Settings {
    /// Checkpoints kept per workload by the retention policy; `None` keeps all.
    pub keep_last: Option<usize>,
    /// Unreferenced packs younger than this are left alone by garbage collection: another
    /// node may be uploading the checkpoint that will reference them.
    pub gc_grace: Duration,
    /// How lazy restores fetch memory.
    pub lazy: FetchSettings,
    /// Whether eager restores have stasisd put memory in place (else CRIU reads image files);
    /// the engine turns it off at start where the kernel does not allow it.
    pub eager_served: bool,
    /// How idle workloads are told from busy ones.
    pub idle: IdleSettings,
    /// Whether dumps track dirty pages where the kernel can (soft-dirty), so that a later
    /// checkpoint of a tree reads only what it wrote since the previous one.
    pub memory_tracking: bool,
    /// How long a preemption notice gives, when notices are watched (periodic intervals of
    /// spot workloads adapt to it).
    pub notice_window: Option<Duration>,
}

impl Default for EngineConfig {
    fn default() -> Self {
        EngineConfig {
            state_dir: DEFAULT_STATE_DIR.into(),
            store_url: DEFAULT_STORE.into(),
            criu_path: default_criu(),
            staging_limit: None,
            compression: Compression::default(),
            store_retry: Duration::from_secs(DEFAULT_STORE_RETRY_SECS),
            network_lock: None,
            network_lock_keep: Duration::from_secs(DEFAULT_NETWORK_LOCK_KEEP_SECS),
            store_key: None,
            rotate_store_key_from: None,
            settings: Settings::default(),
        }
    }
}

impl Default for Settings {
    fn default() -> Self {
        Settings {
            keep_last: Some(DEFAULT_KEEP_LAST),
            gc_grace: Duration::from_secs(DEFAULT_GC_GRACE_SECS),
            lazy: FetchSettings {
                cache_bytes: DEFAULT_LAZY_CACHE_MIB << 20,
                prefetch_bytes: crate::store::PREFETCH_BYTES,
                timeout: Duration::from_secs(DEFAULT_LAZY_TIMEOUT_SECS),
                fresh_first: true,
            },
            eager_served: true,
            memory_tracking: true,
            idle: IdleSettings::default(),
            notice_window: None,
        }
    }
}

/// The CRIU that scripts/setup-criu.sh installed if present, else the first `criu` on PATH,
/// else plain "criu".
fn default_criu() -> PathBuf {
    if let Ok(setup) = setup_criu().canonicalize() {
        return setup;
    }
    crate::linux::find_program("criu").unwrap_or_else(|| "criu".into())
}

/// Where scripts/setup-criu.sh installs CRIU, relative to the source tree stasisd was built
/// from (overridable at build time with STASIS_CRIU_PREFIX).
fn setup_criu() -> PathBuf {
    match option_env!("STASIS_CRIU_PREFIX") {
        Some(prefix) => Path::new(prefix).join("bin/criu"),
        None => Path::new(env!("CARGO_MANIFEST_DIR")).join("../.stasis/criu/bin/criu"),
    }
}
