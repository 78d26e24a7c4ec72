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
//! keep_last = 3                             # checkpoints kept per workload (0: all)
//! gc_grace_secs = 3600                      # age before an unreferenced pack is reclaimed
//! store_retry_secs = 30                     # a remote store request, retries included, ends by then
//! lazy_cache_mib = 1024                     # fetched memory a lazy restore holds ahead
//! lazy_timeout_secs = 60                    # a lazy restore's wait for the store, then kill
//! lazy_prefetch = "fresh-first"             # or "address"
//! eager_restore = "served"                  # or "files": how an eager restore puts memory
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

use std::path::{Path, PathBuf};

use clap::Parser;
use serde::{Deserialize, Serialize};

use crate::criu::NetworkLock;
use crate::engine::{IdleSettings, Thresholds};
use crate::notice::{Cloud, WatchSettings};
use crate::store::crypto::{KeyError, StoreKey};

pub const DEFAULT_SOCKET: &str = "/run/stasis/stasisd.sock";
pub const DEFAULT_STORE: &str = "file:///var/lib/stasis/store";
pub const DEFAULT_STATE_DIR: &str = "/var/lib/stasis/state";
pub const DEFAULT_CONFIG: &str = "/etc/stasis/stasisd.toml";
pub const DEFAULT_KEEP_LAST: usize = 3;
pub const DEFAULT_GC_GRACE_SECS: u64 = 3600;
pub const DEFAULT_STORE_RETRY_SECS: u64 = 30;
pub const DEFAULT_LAZY_CACHE_MIB: u64 = 1024;
pub const DEFAULT_LAZY_TIMEOUT_SECS: u64 = 60;
pub const DEFAULT_NETWORK_LOCK_KEEP_SECS: u64 = 1800;

/// Where scripts/setup-criu.sh installs CRIU, relative to the source tree stasisd was built
/// from (overridable at build time with STASIS_CRIU_PREFIX).
fn setup_criu() -> PathBuf {
    match option_env!("STASIS_CRIU_PREFIX") {
        Some(prefix) => Path::new(prefix).join("bin/criu"),
        None => Path::new(env!("CARGO_MANIFEST_DIR")).join("../.stasis/criu/bin/criu"),
    }
}

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
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default, Deserialize, Serialize, clap::ValueEnum)]
#[serde(rename_all = "lowercase")]
pub enum NetworkLockSetting {
    #[default]
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

/// What a lazy restore prefetches first.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default, Deserialize, Serialize, clap::ValueEnum)]
#[serde(rename_all = "kebab-case")]
pub enum LazyPrefetch {
    /// Address order.
    Address,
    /// Chunks new in the checkpoint (written since the previous one), then address order: a
    /// lazily restored job finds its working set there soonest (bench/RESULTS.md).
    #[default]
    FreshFirst,
}

/// How an eager restore puts memory in place.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default, Deserialize, Serialize, clap::ValueEnum)]
#[serde(rename_all = "lowercase")]
pub enum EagerRestore {
    /// stasisd copies it into the restored processes (userfaultfd) before they run.
    #[default]
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

/// The settings in effect.
#[derive(Debug, Clone, PartialEq)]
pub struct DaemonConfig {
    pub socket: PathBuf,
    pub socket_group: Option<String>,
    pub store_url: String,
    /// The store's encryption key, if any.
    pub store_key: Option<StoreKey>,
    pub rotate_store_key_from: Option<StoreKey>,
    pub state_dir: PathBuf,
    pub criu_path: PathBuf,
    pub log_format: LogFormat,
    pub staging_mib: Option<u64>,
    pub keep_last: usize,
    pub gc_grace_secs: u64,
    pub store_retry_secs: u64,
    pub lazy_cache_mib: u64,
    pub lazy_timeout_secs: u64,
    pub lazy_prefetch: LazyPrefetch,
    pub eager_restore: EagerRestore,
    pub network_lock: NetworkLockSetting,
    pub network_lock_keep_secs: u64,
    pub idle: IdleSettings,
    pub metrics_listen: Option<std::net::SocketAddr>,
    /// Where to watch for preemption notices; `None`: nowhere.
    pub notices: Option<WatchSettings>,
    /// The pod endpoint's socket, if served.
    pub pod_socket: Option<PathBuf>,
}

#[derive(Debug, thiserror::Error)]
pub enum ConfigError {
    #[error("cannot read configuration file {path}")]
    Read {
        path: PathBuf,
        #[source]
        source: std::io::Error,
    },
    #[error("invalid configuration file {path}")]
    Parse {
        path: PathBuf,
        #[source]
        source: toml::de::Error,
    },
    #[error("cannot combine the flags with the configuration file: {0}")]
    Merge(String),
    #[error("invalid store key")]
    Key(#[from] KeyError),
    #[error("invalid setting {key}: {reason}")]
    Invalid { key: &'static str, reason: &'static str },
}

impl DaemonConfig {
    /// Combines flags, the configuration file and defaults.
    pub fn resolve(flags: Args) -> Result<Self, ConfigError> {
        let file = match &flags.config {
            Some(path) => read_file(path)?,
            None if Path::new(DEFAULT_CONFIG).exists() => read_file(Path::new(DEFAULT_CONFIG))?,
            None => Args::default(),
        };
        let flags_rotate = flags.rotate_store_key_from.clone();
        let s = overlay(file, flags)?;
        let idle = idle_settings(&s)?;
        let notices = notice_settings(&s)?;
        let config = Self {
            socket: s.socket.unwrap_or_else(|| DEFAULT_SOCKET.into()),
            socket_group: s.socket_group,
            store_url: s.store.unwrap_or_else(|| DEFAULT_STORE.into()),
            store_key: match (&s.store_key_file, std::env::var("STASIS_STORE_KEY")) {
                (Some(path), _) => Some(StoreKey::read_file(path)?),
                (None, Ok(hex)) => Some(StoreKey::from_hex(&hex)?),
                (None, Err(_)) => None,
            },
            rotate_store_key_from: flags_rotate.as_deref().map(StoreKey::read_file).transpose()?,
            state_dir: s.state_dir.unwrap_or_else(|| DEFAULT_STATE_DIR.into()),
            criu_path: s.criu.unwrap_or_else(default_criu),
            log_format: s.log_format.unwrap_or_default(),
            staging_mib: s.staging_mib,
            keep_last: s.keep_last.unwrap_or(DEFAULT_KEEP_LAST),
            gc_grace_secs: s.gc_grace_secs.unwrap_or(DEFAULT_GC_GRACE_SECS),
            store_retry_secs: s.store_retry_secs.unwrap_or(DEFAULT_STORE_RETRY_SECS),
            lazy_cache_mib: s.lazy_cache_mib.unwrap_or(DEFAULT_LAZY_CACHE_MIB),
            lazy_timeout_secs: s.lazy_timeout_secs.unwrap_or(DEFAULT_LAZY_TIMEOUT_SECS),
            lazy_prefetch: s.lazy_prefetch.unwrap_or_default(),
            eager_restore: s.eager_restore.unwrap_or_default(),
            network_lock: s.network_lock.unwrap_or_default(),
            network_lock_keep_secs: s.network_lock_keep_secs.unwrap_or(DEFAULT_NETWORK_LOCK_KEEP_SECS),
            idle,
            metrics_listen: s.metrics_listen,
            notices,
            pod_socket: s.pod_socket,
        };
        if config.lazy_timeout_secs == 0 || config.lazy_timeout_secs > 86_400 {
            let reason = "must be 1 to 86400 seconds (a lazy restore kills the tree when it passes)";
            return Err(ConfigError::Invalid { key: "lazy_timeout_secs", reason });
        }
        Ok(config)
    }
}

/// The idle-reclaim settings, defaults for those not given.
fn idle_settings(s: &Args) -> Result<IdleSettings, ConfigError> {
    let default = IdleSettings::default();
    let cpu_percent = s.idle_cpu_percent.unwrap_or(default.thresholds.cpu_percent);
    if !(0.0..=100.0).contains(&cpu_percent) {
        return Err(ConfigError::Invalid { key: "idle_cpu_percent", reason: "must be 0 to 100" });
    }
    let tick = s.idle_tick_ms.map(std::time::Duration::from_millis).unwrap_or(default.tick);
    if !(std::time::Duration::from_millis(50)..=std::time::Duration::from_secs(600)).contains(&tick) {
        return Err(ConfigError::Invalid { key: "idle_tick_ms", reason: "must be 50 to 600000" });
    }
    let read_bytes_per_sec = s.idle_read_bytes_per_sec.unwrap_or(default.thresholds.read_bytes_per_sec);
    Ok(IdleSettings { thresholds: Thresholds { cpu_percent, read_bytes_per_sec }, tick })
}

/// Where to watch for preemption notices, if anywhere.
fn notice_settings(s: &Args) -> Result<Option<WatchSettings>, ConfigError> {
    let poll = std::time::Duration::from_millis(s.notice_poll_ms.unwrap_or(2000));
    if !(std::time::Duration::from_millis(100)..=std::time::Duration::from_secs(60)).contains(&poll) {
        return Err(ConfigError::Invalid { key: "notice_poll_ms", reason: "must be 100 to 60000" });
    }
    if let Some(url) = &s.notice_url
        && url::Url::parse(url).map_or(true, |u| u.scheme() != "http")
    {
        return Err(ConfigError::Invalid { key: "notice_url", reason: "must be an http:// URL" });
    }
    Ok(s.notices.unwrap_or_default().cloud().map(|cloud| WatchSettings {
        cloud,
        base_url: s.notice_url.clone().unwrap_or_else(|| cloud.default_base_url().into()),
        poll,
    }))
}

/// `flags` over `file`: each setting given on the command line replaces the file's.
fn overlay(file: Args, flags: Args) -> Result<Args, ConfigError> {
    let object = |args: Args| match serde_json::to_value(args) {
        Ok(serde_json::Value::Object(map)) => Ok(map),
        Ok(_) => Err(ConfigError::Merge("settings are not a table".into())),
        Err(e) => Err(ConfigError::Merge(e.to_string())),
    };
    let mut merged = object(file)?;
    merged.extend(object(flags)?.into_iter().filter(|(_, value)| !value.is_null()));
    serde_json::from_value(serde_json::Value::Object(merged)).map_err(|e| ConfigError::Merge(e.to_string()))
}

fn read_file(path: &Path) -> Result<Args, ConfigError> {
    let text =
        std::fs::read_to_string(path).map_err(|source| ConfigError::Read { path: path.into(), source })?;
    toml::from_str(&text).map_err(|source| ConfigError::Parse { path: path.into(), source })
}

/// The setup script's CRIU if present, else the first `criu` on PATH, else plain "criu".
fn default_criu() -> PathBuf {
    let setup = setup_criu();
    if let Ok(setup) = setup.canonicalize() {
        return setup;
    }
    crate::linux::find_program("criu").unwrap_or_else(|| "criu".into())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn flags_override_file_which_overrides_defaults() {
        let dir = tempfile::tempdir().unwrap();
        let file = dir.path().join("c.toml");
        std::fs::write(
            &file,
            "store = \"s3://b/p\"\nsocket = \"/tmp/file.sock\"\nlog_format = \"json\"\nlazy_prefetch = \"address\"\neager_restore = \"files\"\nnetwork_lock = \"iptables\"\n",
        )
        .unwrap();
        let args =
            Args { config: Some(file.clone()), socket: Some("/tmp/flag.sock".into()), ..Default::default() };
        let c = DaemonConfig::resolve(args).unwrap();
        assert_eq!(c.socket, PathBuf::from("/tmp/flag.sock"));
        assert_eq!(c.store_url, "s3://b/p");
        assert_eq!(c.state_dir, PathBuf::from(DEFAULT_STATE_DIR));
        assert_eq!(c.log_format, LogFormat::Json);
        assert_eq!(
            (c.lazy_prefetch, c.eager_restore, c.lazy_timeout_secs),
            (LazyPrefetch::Address, EagerRestore::Files, DEFAULT_LAZY_TIMEOUT_SECS)
        );
        let defaults = DaemonConfig::resolve(Args::default()).unwrap();
        assert_eq!(
            (defaults.lazy_prefetch, defaults.eager_restore),
            (LazyPrefetch::FreshFirst, EagerRestore::Served)
        );
        assert_eq!(c.network_lock.forced(), Some(NetworkLock::Iptables));
        assert_eq!(DaemonConfig::resolve(Args::default()).unwrap().network_lock.forced(), None);
        let missing =
            DaemonConfig::resolve(Args { config: Some(dir.path().join("none.toml")), ..Default::default() });
        assert!(matches!(missing, Err(ConfigError::Read { .. })), "a named configuration file must exist");
        let zero = DaemonConfig::resolve(Args { lazy_timeout_secs: Some(0), ..Default::default() });
        assert!(matches!(zero, Err(ConfigError::Invalid { key: "lazy_timeout_secs", .. })));
        std::fs::write(&file, "sokket = 1\n").unwrap();
        let err = DaemonConfig::resolve(Args { config: Some(file), ..Default::default() }).unwrap_err();
        assert!(matches!(err, ConfigError::Parse { .. }));
    }
}
