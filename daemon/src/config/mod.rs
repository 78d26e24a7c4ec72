//! stasisd's settings: command-line flags over a TOML file over defaults.
//!
//! ```toml
//! # /etc/stasis/stasisd.toml
//! socket = "/run/stasis/stasisd.sock"
//! socket_group = "stasis"                   # members may connect, each acting on its own
//! store = "file:///var/lib/stasis/store"   # or s3://bucket/prefix, gs://..., az://...
//! store_key_file = "/etc/stasis/store.key"  # encrypt the store (64 hex digits; or STASIS_STORE_KEY)
//! state_dir = "/var/lib/stasis/state"
//! criu = "/usr/local/sbin/criu"
//! log_format = "text"                       # or "json"
//! staging_mib = 4096                        # dumped pages held in memory before spilling
//! compression = "zstd"                      # or "lz4": faster restores, a larger store
//! keep_last = 3                             # checkpoints kept per workload (0: all)
//! gc_grace_secs = 3600                      # age before an unreferenced pack is reclaimed
//! store_retry_secs = 30                     # a remote store request, retries included, ends by then
//! lazy_cache_mib = 1024                     # fetched memory a lazy restore holds ahead
//! lazy_timeout_secs = 60                    # a lazy restore's wait for the store, then kill
//! lazy_prefetch = "fresh-first"             # or "address"
//! eager_restore = "served"                  # or "files": how an eager restore puts memory
//! memory_tracking = "auto"                  # or "off": later checkpoints read only written pages
//! network_lock = "auto"                     # or "nftables", "iptables"
//! network_lock_keep_secs = 1800             # an eviction's lock kept for a restore here
//! metrics_listen = "127.0.0.1:9464"        # Prometheus metrics on /metrics (off by default)
//! idle_cpu_percent = 0.5                    # idle reclaim: above this a workload is busy
//! idle_read_bytes_per_sec = 1024            #   ... or above this many bytes read
//! idle_tick_ms = 1000                       #   ... sampled this often
//! notices = "auto"                          # preemption notices: auto, off, aws, gcp, azure
//! notice_url = "http://169.254.169.254"     #   ... the metadata service (the cloud's own)
//! notice_poll_ms = 2000                     #   ... asked this often
//! pod_socket = "/run/stasis/pod/pod.sock"   # Kubernetes: the endpoint containers reach (off by default)
//! ```

mod resolve;

use std::path::PathBuf;

use clap::Parser;
use serde::{Deserialize, Serialize};

use crate::criu::NetworkLock;
use crate::notice::Cloud;
pub use resolve::{ConfigError, DaemonConfig};

pub const DEFAULT_SOCKET: &str = "/run/stasis/stasisd.sock";
pub const DEFAULT_CONFIG: &str = "/etc/stasis/stasisd.toml";

/// stasisd: the stasis checkpoint/restore daemon.
///
/// Each setting is declared once, here: as a command-line flag (clap) and as the key of the
/// same name in the TOML file (serde). Flags win over the file, the file over the defaults.
#[derive(Debug, Clone, Parser, Default, Deserialize, Serialize)]
#[command(version, about)]
#[serde(deny_unknown_fields)]
pub struct Args {
    /// TOML configuration file (default /etc/stasis/stasisd.toml, if it exists).
    #[arg(long)]
    #[serde(skip)]
    pub config: Option<PathBuf>,
    /// Unix socket to serve the API on.
    #[arg(long)]
    pub socket: Option<PathBuf>,
    /// Let members of this group connect too (the socket is root's alone otherwise); each
    /// acts only on its own processes and checkpoints.
    #[arg(long)]
    pub socket_group: Option<String>,
    /// Store URL: file:///dir, s3://bucket/prefix, gs://bucket/prefix or az://container/prefix.
    #[arg(long)]
    pub store: Option<String>,
    /// File holding the store's encryption key (64 hex digits); the environment variable
    /// STASIS_STORE_KEY may hold it instead. Without either, an unencrypted store is used.
    #[arg(long)]
    pub store_key_file: Option<PathBuf>,
    /// Re-wrap the store's data key from the key in this file to the configured one, once, at
    /// start (key rotation: checkpoints stay readable, nothing is re-encrypted).
    #[arg(long)]
    #[serde(skip)]
    pub rotate_store_key_from: Option<PathBuf>,
    /// Directory for logs of managed workloads, scratch images and the workload registry.
    #[arg(long)]
    pub state_dir: Option<PathBuf>,
    /// CRIU executable (default: the one scripts/setup-criu.sh installed, else `criu` on PATH).
    #[arg(long, env = "STASIS_CRIU")]
    pub criu: Option<PathBuf>,
    /// Log format: text or json.
    #[arg(long)]
    pub log_format: Option<LogFormat>,
    /// MiB of dumped pages held in memory before spilling to a staging file (default: a
    /// quarter of RAM).
    #[arg(long)]
    pub staging_mib: Option<u64>,
    /// How new chunks are compressed: zstd (the default: the smaller store and upload) or
    /// lz4 (restores decompress it a few times faster, for about 1.5 times the stored bytes
    /// on text-like memory); chunks already stored are read as they were written.
    #[arg(long)]
    pub compression: Option<CompressionSetting>,
    /// Checkpoints kept per workload; older ones are deleted after each checkpoint (0 keeps
    /// all; default 3).
    #[arg(long)]
    pub keep_last: Option<usize>,
    /// Unreferenced packs younger than this many seconds are not reclaimed (another node may
    /// be uploading the checkpoint that uses them; default 3600).
    #[arg(long)]
    pub gc_grace_secs: Option<u64>,
    /// Seconds one request to a remote store may take, retries included: a hung request is
    /// cut then (default 30: an evicted tree stays stopped while its checkpoint is stored).
    #[arg(long)]
    pub store_retry_secs: Option<u64>,
    /// MiB of fetched, not yet served memory a lazy restore may hold (default 1024).
    #[arg(long)]
    pub lazy_cache_mib: Option<u64>,
    /// Seconds a lazy restore waits for the store to deliver memory; after that the restored
    /// tree is killed, since its memory cannot be completed (default 60).
    #[arg(long)]
    pub lazy_timeout_secs: Option<u64>,
    /// What a restore fetches first: memory written since the previous checkpoint, the job's
    /// working set (fresh-first, the default), or plain address order (address).
    #[arg(long)]
    pub lazy_prefetch: Option<LazyPrefetch>,
    /// How an eager restore puts memory in place: served (stasisd copies it into the restored
    /// processes, which run once it is all there; the default where the kernel allows) or
    /// files (written into image files for CRIU to read, as where it does not).
    #[arg(long)]
    pub eager_restore: Option<EagerRestore>,
    /// Whether a later checkpoint of a tree reads only the pages it wrote since its previous
    /// one (auto: where the kernel tracks soft-dirty pages, the default) or all of them (off).
    #[arg(long)]
    pub memory_tracking: Option<MemoryTracking>,
    /// How CRIU locks established TCP connections while it dumps them: auto (nftables when
    /// CRIU and the kernel have it, else iptables when installed), nftables or iptables.
    #[arg(long)]
    pub network_lock: Option<NetworkLockSetting>,
    /// Seconds the network lock of an evicted tree's connections is kept for a restore on this
    /// node (default 1800; by then TCP peers have given up on the connections).
    #[arg(long)]
    pub network_lock_keep_secs: Option<u64>,
    /// Serve Prometheus metrics on this address (`GET /metrics`), e.g. 127.0.0.1:9464;
    /// off unless given.
    #[arg(long)]
    pub metrics_listen: Option<std::net::SocketAddr>,
    /// Idle reclaim: CPU use (percent of one core, averaged over a tick) above which a
    /// workload counts as busy (default 0.5).
    #[arg(long)]
    pub idle_cpu_percent: Option<f64>,
    /// Idle reclaim: bytes read per second (from sockets, pipes or files) above which a
    /// workload counts as busy (default 1024).
    #[arg(long)]
    pub idle_read_bytes_per_sec: Option<u64>,
    /// Idle reclaim: milliseconds between samples of a workload's activity (default 1000).
    #[arg(long)]
    pub idle_tick_ms: Option<u64>,
    /// Preemption notices to watch for: auto (the cloud this machine runs on, none elsewhere;
    /// the default), off, aws, gcp or azure. On one, spot workloads are evicted in time.
    #[arg(long)]
    pub notices: Option<NoticeSetting>,
    /// Base URL of the metadata service that gives the notices (default: the cloud's own).
    #[arg(long)]
    pub notice_url: Option<String>,
    /// Milliseconds between questions to the metadata service (default 2000).
    #[arg(long)]
    pub notice_poll_ms: Option<u64>,
    /// Kubernetes: serve the pod endpoint (what opted-in containers mount and reach; not the
    /// API) on this socket. Off by default.
    #[arg(long)]
    pub pod_socket: Option<PathBuf>,
}

/// The `notices` setting.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default, Deserialize, Serialize, clap::ValueEnum)]
#[serde(rename_all = "lowercase")]
pub enum NoticeSetting {
    #[default]
    Auto,
    Off,
    Aws,
    Gcp,
    Azure,
}

impl NoticeSetting {
    /// The cloud to watch: the one named, or for auto the one detected.
    fn cloud(self) -> Option<Cloud> {
        match self {
            Self::Auto => Cloud::detect(),
            Self::Off => None,
            Self::Aws => Some(Cloud::Aws),
            Self::Gcp => Some(Cloud::Gcp),
            Self::Azure => Some(Cloud::Azure),
        }
    }
}

/// The `network_lock` setting.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Deserialize, Serialize, clap::ValueEnum)]
#[serde(rename_all = "lowercase")]
pub enum NetworkLockSetting {
    Auto,
    Nftables,
    Iptables,
}

impl NetworkLockSetting {
    /// The lock asked for, `None` for auto.
    pub fn forced(self) -> Option<NetworkLock> {
        match self {
            Self::Auto => None,
            Self::Nftables => Some(NetworkLock::Nftables),
            Self::Iptables => Some(NetworkLock::Iptables),
        }
    }
}

/// How new chunks are compressed (see [`crate::store::Compression`]).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Deserialize, Serialize, clap::ValueEnum)]
#[serde(rename_all = "kebab-case")]
pub enum CompressionSetting {
    Zstd,
    Lz4,
}

impl From<CompressionSetting> for crate::store::Compression {
    fn from(c: CompressionSetting) -> Self {
        match c {
            CompressionSetting::Zstd => crate::store::Compression::Zstd,
            CompressionSetting::Lz4 => crate::store::Compression::Lz4,
        }
    }
}

/// What a lazy restore prefetches first.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Deserialize, Serialize, clap::ValueEnum)]
#[serde(rename_all = "kebab-case")]
pub enum LazyPrefetch {
    /// Address order.
    Address,
    /// Chunks new in the checkpoint (written since the previous one), then address order: a
    /// lazily restored job finds its working set there soonest (bench/RESULTS.md).
    FreshFirst,
}

/// Whether dumps track dirty pages.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Deserialize, Serialize, clap::ValueEnum)]
#[serde(rename_all = "lowercase")]
pub enum MemoryTracking {
    /// Where the kernel tracks soft-dirty pages.
    Auto,
    /// Never: every checkpoint reads all memory.
    Off,
}

/// How an eager restore puts memory in place.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Deserialize, Serialize, clap::ValueEnum)]
#[serde(rename_all = "lowercase")]
pub enum EagerRestore {
    /// stasisd copies it into the restored processes (userfaultfd) before they run.
    Served,
    /// Written into image files that CRIU reads.
    Files,
}

#[derive(Debug, Clone, Copy, PartialEq, Eq, Default, Deserialize, Serialize, clap::ValueEnum)]
#[serde(rename_all = "lowercase")]
pub enum LogFormat {
    #[default]
    Text,
    Json,
}
