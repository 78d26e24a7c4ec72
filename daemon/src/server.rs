//! The daemon's lifecycle: start the engine, serve the API on a root-only Unix socket, and on
//! SIGTERM or SIGINT stop taking requests and let running jobs finish.

use std::io;
use std::os::unix::fs::{DirBuilderExt, FileTypeExt};

use nix::sys::stat::{Mode, umask};
use std::path::{Path, PathBuf};

use tokio::net::UnixListener;
use tokio::signal::unix::{SignalKind, signal};
use tokio_stream::wrappers::UnixListenerStream;
use tracing::info;

use crate::config::DaemonConfig;
use crate::engine::{Engine, StartError};
use crate::grpc::{StasisServer, StasisService};

#[derive(Debug, thiserror::Error)]
pub enum ServeError {
    #[error(transparent)]
    Start(#[from] StartError),
    #[error("another stasisd is already serving on {0}")]
    SocketInUse(PathBuf),
    #[error("cannot listen on {path}")]
    Socket {
        path: PathBuf,
        #[source]
        source: io::Error,
    },
    #[error("cannot serve metrics on {addr}")]
    Metrics {
        addr: std::net::SocketAddr,
        #[source]
        source: io::Error,
    },
    #[error("unknown socket group {0:?}")]
    UnknownGroup(String),
    #[error("cannot watch for termination signals")]
    Signals(#[source] io::Error),
    #[error("the API server failed")]
    Transport(#[source] tonic::transport::Error),
}

/// Runs stasisd until SIGTERM or SIGINT, then drains running jobs.
pub async fn serve(config: DaemonConfig) -> Result<(), ServeError> {
    let engine = Engine::start(config.engine).await?;
    tokio::spawn(release_freed_memory());
    if let Some(addr) = config.metrics_listen {
        crate::metrics::serve(addr, engine.metrics())
            .await
            .map_err(|source| ServeError::Metrics { addr, source })?;
    }
    let notices = match &config.notices {
        Some(settings) => {
            crate::notice::start(&engine, settings.clone());
            format!(
                "{} ({}, every {} ms)",
                settings.cloud.name(),
                settings.base_url,
                settings.poll.as_millis()
            )
        }
        None => "off".to_owned(),
    };
    if let Some(path) = config.pod_socket.clone() {
        let engine = engine.clone();
        tokio::spawn(async move {
            if let Err(e) = crate::engine::pods::serve_endpoint(engine, &path).await {
                tracing::error!(socket = %path.display(), error = %e, "the pod endpoint stopped");
            }
        });
    }
    let listener = bind(&config.socket)?;
    if let Some(group) = &config.socket_group {
        open_to_group(&config.socket, group)?;
    }
    let mut term = signal(SignalKind::terminate()).map_err(ServeError::Signals)?;
    let mut int = signal(SignalKind::interrupt()).map_err(ServeError::Signals)?;
    let stop = async move {
        tokio::select! {
            _ = term.recv() => info!("SIGTERM received, shutting down"),
            _ = int.recv() => info!("SIGINT received, shutting down"),
        }
    };
    info!(socket = %config.socket.display(), "serving");
    let served = tonic::transport::Server::builder()
        .add_service(StasisServer::new(StasisService::new(engine.clone(), notices)))
        .serve_with_incoming_shutdown(UnixListenerStream::new(listener), stop)
        .await;
    engine.jobs().close();
    if !engine.jobs().is_empty() {
        info!(jobs = engine.jobs().len(), "waiting for running jobs to finish");
    }
    engine.jobs().wait().await;
    let _ = std::fs::remove_file(&config.socket);
    info!("stopped");
    served.map_err(ServeError::Transport)
}

/// Binds the API socket with mode 0600, replacing a stale socket file but never a live one.
fn bind(path: &Path) -> Result<UnixListener, ServeError> {
    let err = |source| ServeError::Socket { path: path.to_path_buf(), source };
    if let Some(parent) = path.parent() {
        std::fs::DirBuilder::new().recursive(true).mode(0o755).create(parent).map_err(err)?;
    }
    if let Ok(meta) = std::fs::symlink_metadata(path) {
        if !meta.file_type().is_socket() {
            return Err(err(io::Error::new(io::ErrorKind::AlreadyExists, "a non-socket file is in the way")));
        }
        if std::os::unix::net::UnixStream::connect(path).is_ok() {
            return Err(ServeError::SocketInUse(path.to_path_buf()));
        }
        std::fs::remove_file(path).map_err(err)?;
    }
    // Created with mode 0600 rather than changed after: no moment in which others may connect.
    // The umask is the process's; nothing else creates files while the daemon starts serving.
    let old = umask(Mode::from_bits_truncate(0o177));
    let listener = UnixListener::bind(path);
    umask(old);
    listener.map_err(err)
}

/// Lets members of `group` connect to the socket at `path` (mode 0660, group-owned).
fn open_to_group(path: &Path, group: &str) -> Result<(), ServeError> {
    let found = nix::unistd::Group::from_name(group).ok().flatten();
    let gid = found.ok_or_else(|| ServeError::UnknownGroup(group.into()))?.gid;
    let err = |source| ServeError::Socket { path: path.to_path_buf(), source };
    std::os::unix::fs::chown(path, None, Some(gid.as_raw())).map_err(err)?;
    std::fs::set_permissions(path, std::os::unix::fs::PermissionsExt::from_mode(0o660)).map_err(err)?;
    info!(group, "members of the socket group may connect, each acting on its own");
    Ok(())
}

/// How long memory stasisd freed stays kept for its next buffers before it goes back.
const FREED_MEMORY_KEPT: std::time::Duration = std::time::Duration::from_secs(10);

/// Hands the memory stasisd's allocator keeps (see `main`) back to the system every
/// [`FREED_MEMORY_KEPT`]: a restore or a dump reuses its freed buffers meanwhile, and a
/// stasisd with nothing to do gives them back within that.
async fn release_freed_memory() {
    let mut every = tokio::time::interval(FREED_MEMORY_KEPT);
    every.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
    loop {
        every.tick().await;
        let _ = tokio::task::spawn_blocking(crate::linux::sys::release_freed_memory).await;
    }
}

#[cfg(test)]
mod tests {
    use std::os::unix::fs::PermissionsExt;

    use super::*;

    #[tokio::test]
    async fn the_socket_is_created_root_only_and_a_live_one_is_never_replaced() {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("run/stasisd.sock");
        let listener = bind(&path).unwrap();
        let mode = std::fs::metadata(&path).unwrap().permissions().mode() & 0o777;
        assert_eq!(mode, 0o600, "socket mode {mode:o}");
        assert!(matches!(bind(&path), Err(ServeError::SocketInUse(_))));
        drop(listener);
        // A stale socket file (nobody listening) is replaced.
        bind(&path).unwrap();
    }
}
