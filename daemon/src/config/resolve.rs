//! stasisd's settings resolved: flags over the file over defaults, into the daemon's own
//! ([`DaemonConfig`]) and the engine's ([`EngineConfig`], whose `Default` has its defaults).

use std::path::{Path, PathBuf};
use std::time::Duration;

use super::{
    Args, DEFAULT_CONFIG, DEFAULT_SOCKET, EagerRestore, LazyPrefetch, LogFormat, MemoryTracking,
    NetworkLockSetting,
};
use crate::engine::{EngineConfig, IdleSettings, Settings, Thresholds};
use crate::notice::WatchSettings;
use crate::store::FetchSettings;
use crate::store::crypto::{KeyError, StoreKey};

/// The settings in effect: the daemon's own, and the engine's.
#[derive(Debug, Clone, PartialEq)]
pub struct DaemonConfig {
    pub socket: PathBuf,
    pub socket_group: Option<String>,
    pub log_format: LogFormat,
    pub metrics_listen: Option<std::net::SocketAddr>,
    /// Where to watch for preemption notices; `None`: nowhere.
    pub notices: Option<WatchSettings>,
    /// The pod endpoint's socket, if served.
    pub pod_socket: Option<PathBuf>,
    /// How the engine is set.
    pub engine: EngineConfig,
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
        let rotate_from = flags.rotate_store_key_from.clone();
        let s = overlay(file, flags)?;
        let idle = idle_settings(&s)?;
        let notices = notice_settings(&s)?;
        let notice_window = notices.as_ref().map(|n| n.cloud.notice_window());
        let engine = engine_config(&s, idle, notice_window, rotate_from.as_deref())?;
        Ok(Self {
            socket: s.socket.unwrap_or_else(|| DEFAULT_SOCKET.into()),
            socket_group: s.socket_group,
            log_format: s.log_format.unwrap_or_default(),
            metrics_listen: s.metrics_listen,
            notices,
            pod_socket: s.pod_socket,
            engine,
        })
    }
}

/// The engine's settings: those of `s` given, with `idle`, `notice_window` and the key to
/// rotate from; the engine's defaults for the others.
fn engine_config(
    s: &Args,
    idle: IdleSettings,
    notice_window: Option<Duration>,
    rotate_from: Option<&Path>,
) -> Result<EngineConfig, ConfigError> {
    let d = EngineConfig::default();
    let secs = |given: Option<u64>, default: Duration| given.map_or(default, Duration::from_secs);
    let mib = |given: Option<u64>| given.map(|mib| mib << 20);
    let settings = Settings {
        keep_last: s.keep_last.map_or(d.settings.keep_last, |n| (n > 0).then_some(n)),
        gc_grace: secs(s.gc_grace_secs, d.settings.gc_grace),
        lazy: FetchSettings {
            cache_bytes: mib(s.lazy_cache_mib).unwrap_or(d.settings.lazy.cache_bytes),
            prefetch_bytes: d.settings.lazy.prefetch_bytes,
            timeout: secs(s.lazy_timeout_secs, d.settings.lazy.timeout),
            fresh_first: s
                .lazy_prefetch
                .map_or(d.settings.lazy.fresh_first, |p| p == LazyPrefetch::FreshFirst),
        },
        eager_served: s.eager_restore.map_or(d.settings.eager_served, |e| e == EagerRestore::Served),
        memory_tracking: s.memory_tracking.map_or(d.settings.memory_tracking, |t| t == MemoryTracking::Auto),
        idle,
        notice_window,
    };
    let config = EngineConfig {
        state_dir: s.state_dir.clone().unwrap_or(d.state_dir),
        store_url: s.store.clone().unwrap_or(d.store_url),
        criu_path: s.criu.clone().unwrap_or(d.criu_path),
        staging_limit: mib(s.staging_mib).or(d.staging_limit),
        compression: s.compression.map_or(d.compression, Into::into),
        store_retry: secs(s.store_retry_secs, d.store_retry),
        network_lock: s.network_lock.map_or(d.network_lock, NetworkLockSetting::forced),
        network_lock_keep: secs(s.network_lock_keep_secs, d.network_lock_keep),
        store_key: match (&s.store_key_file, std::env::var("STASIS_STORE_KEY")) {
            (Some(path), _) => Some(StoreKey::read_file(path)?),
            (None, Ok(hex)) => Some(StoreKey::from_hex(&hex)?),
            (None, Err(_)) => d.store_key,
        },
        rotate_store_key_from: rotate_from.map(StoreKey::read_file).transpose()?,
        settings,
    };
    let timeout = config.settings.lazy.timeout;
    if timeout.is_zero() || timeout > Duration::from_secs(86_400) {
        let reason = "must be 1 to 86400 seconds (a lazy restore kills the tree when it passes)";
        return Err(ConfigError::Invalid { key: "lazy_timeout_secs", reason });
    }
    Ok(config)
}

/// The idle-reclaim settings, defaults for those not given.
fn idle_settings(s: &Args) -> Result<IdleSettings, ConfigError> {
    let default = IdleSettings::default();
    let cpu_percent = s.idle_cpu_percent.unwrap_or(default.thresholds.cpu_percent);
    if !(0.0..=100.0).contains(&cpu_percent) {
        return Err(ConfigError::Invalid { key: "idle_cpu_percent", reason: "must be 0 to 100" });
    }
    let tick = s.idle_tick_ms.map(Duration::from_millis).unwrap_or(default.tick);
    if !(Duration::from_millis(50)..=Duration::from_secs(600)).contains(&tick) {
        return Err(ConfigError::Invalid { key: "idle_tick_ms", reason: "must be 50 to 600000" });
    }
    let read_bytes_per_sec = s.idle_read_bytes_per_sec.unwrap_or(default.thresholds.read_bytes_per_sec);
    Ok(IdleSettings { thresholds: Thresholds { cpu_percent, read_bytes_per_sec }, tick })
}

/// Where to watch for preemption notices, if anywhere.
fn notice_settings(s: &Args) -> Result<Option<WatchSettings>, ConfigError> {
    let poll = Duration::from_millis(s.notice_poll_ms.unwrap_or(2000));
    if !(Duration::from_millis(100)..=Duration::from_secs(60)).contains(&poll) {
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

#[cfg(test)]
mod tests {
    use super::*;
    use crate::criu::NetworkLock;
    use crate::store::Compression;

    #[test]
    fn flags_override_file_which_overrides_defaults() {
        let dir = tempfile::tempdir().unwrap();
        let file = dir.path().join("c.toml");
        std::fs::write(
            &file,
            "store = \"s3://b/p\"\nsocket = \"/tmp/file.sock\"\nlog_format = \"json\"\nlazy_prefetch = \"address\"\neager_restore = \"files\"\nmemory_tracking = \"off\"\nnetwork_lock = \"iptables\"\nkeep_last = 5\ncompression = \"lz4\"\n",
        )
        .unwrap();
        let args = Args {
            config: Some(file.clone()),
            socket: Some("/tmp/flag.sock".into()),
            keep_last: Some(0),
            ..Default::default()
        };
        let c = DaemonConfig::resolve(args).unwrap();
        let defaults = EngineConfig::default();
        assert_eq!(c.socket, PathBuf::from("/tmp/flag.sock"));
        assert_eq!(c.engine.store_url, "s3://b/p");
        assert_eq!(c.engine.state_dir, defaults.state_dir);
        assert_eq!(c.log_format, LogFormat::Json);
        let lazy = c.engine.settings.lazy;
        assert_eq!(
            (lazy.fresh_first, c.engine.settings.eager_served, lazy.timeout),
            (false, false, defaults.settings.lazy.timeout)
        );
        assert_eq!(c.engine.network_lock, Some(NetworkLock::Iptables));
        assert_eq!((c.engine.compression, defaults.compression), (Compression::Lz4, Compression::Zstd));
        assert_eq!(c.engine.settings.keep_last, None, "0 keeps all");
        assert!(!c.engine.settings.memory_tracking && defaults.settings.memory_tracking);
        let missing =
            DaemonConfig::resolve(Args { config: Some(dir.path().join("none.toml")), ..Default::default() });
        assert!(matches!(missing, Err(ConfigError::Read { .. })), "a named configuration file must exist");
        let zero = DaemonConfig::resolve(Args { lazy_timeout_secs: Some(0), ..Default::default() });
        assert!(matches!(zero, Err(ConfigError::Invalid { key: "lazy_timeout_secs", .. })));
        std::fs::write(&file, "sokket = 1\n").unwrap();
        let err = DaemonConfig::resolve(Args { config: Some(file), ..Default::default() }).unwrap_err();
        assert!(matches!(err, ConfigError::Parse { .. }));
    }

    #[test]
    fn nothing_given_resolves_to_the_documented_defaults() {
        let c = DaemonConfig::resolve(Args::default()).unwrap();
        assert_eq!((c.socket.to_str(), c.log_format), (Some("/run/stasis/stasisd.sock"), LogFormat::Text));
        // The notice window is the cloud's this machine runs on, if any.
        let settings = Settings { notice_window: c.engine.settings.notice_window, ..Default::default() };
        assert_eq!(c.engine, EngineConfig { settings, ..Default::default() });
        let (e, secs) = (c.engine, Duration::from_secs);
        assert_eq!(
            (e.state_dir.to_str(), &*e.store_url),
            (Some("/var/lib/stasis/state"), "file:///var/lib/stasis/store")
        );
        assert_eq!(
            (e.settings.keep_last, e.settings.gc_grace, e.store_retry),
            (Some(3), secs(3600), secs(30))
        );
        assert_eq!(
            e.settings.lazy,
            FetchSettings {
                cache_bytes: 1 << 30,
                prefetch_bytes: 64 << 20,
                timeout: secs(60),
                fresh_first: true
            }
        );
        assert_eq!((e.staging_limit, e.settings.eager_served), (None, true));
        assert_eq!((e.network_lock, e.network_lock_keep), (None, secs(1800)));
    }

    #[test]
    fn flags_are_converted_to_the_engines_units() {
        let args = Args {
            staging_mib: Some(8),
            keep_last: Some(2),
            gc_grace_secs: Some(0),
            store_retry_secs: Some(5),
            lazy_cache_mib: Some(16),
            lazy_timeout_secs: Some(3),
            network_lock_keep_secs: Some(7),
            idle_tick_ms: Some(250),
            ..Default::default()
        };
        let e = DaemonConfig::resolve(args).unwrap().engine;
        assert_eq!((e.staging_limit, e.settings.keep_last), (Some(8 << 20), Some(2)));
        assert_eq!((e.settings.gc_grace, e.store_retry), (Duration::ZERO, Duration::from_secs(5)));
        assert_eq!(
            (e.settings.lazy.cache_bytes, e.settings.lazy.timeout),
            (16 << 20, Duration::from_secs(3))
        );
        assert_eq!(
            (e.network_lock_keep, e.settings.idle.tick),
            (Duration::from_secs(7), Duration::from_millis(250))
        );
    }
}
