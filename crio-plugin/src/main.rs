//! stasis-nri's command line: connect to the runtime's NRI socket and stay connected,
//! registering again whenever the runtime restarts (which re-synchronizes every container).
#![forbid(unsafe_code)]

use std::path::PathBuf;
use std::sync::Arc;
use std::time::Duration;

use clap::Parser;
use stasis_nri::inventory::Injection;
use stasis_nri::plugin::{self, Settings};
use stasis_nri::stasisd::Api;
use tracing::warn;

#[derive(Debug, Parser)]
#[command(version, about)]
struct Args {
    /// The runtime's NRI socket.
    #[arg(long, env = "NRI_PLUGIN_SOCKET", default_value = "/var/run/nri/nri.sock")]
    nri_socket: PathBuf,
    /// The plugin's name, and where among plugins it is called.
    #[arg(long, env = "NRI_PLUGIN_NAME", default_value = "stasis")]
    name: String,
    #[arg(long, env = "NRI_PLUGIN_IDX", default_value = "50")]
    index: String,
    /// stasisd's API socket.
    #[arg(long, default_value = "/run/stasis/stasisd.sock")]
    stasis_socket: PathBuf,
    /// The runtime's CRI socket (containerd's /run/containerd/containerd.sock, CRI-O's
    /// /var/run/crio/crio.sock): containers' images are then known by digest, not name.
    #[arg(long)]
    cri_socket: Option<PathBuf>,
    /// The pod bundle (scripts/pod-bundle.sh and stasis-pod), on this host.
    #[arg(long, default_value = "/var/lib/stasis/pod-bundle")]
    bundle: PathBuf,
    /// The directory of stasisd's pod endpoint (`--pod-socket`), on this host.
    #[arg(long, default_value = "/run/stasis/pod")]
    endpoint_dir: PathBuf,
}

/// How long to wait before connecting again to a runtime that went away.
const RECONNECT: Duration = Duration::from_secs(1);

#[tokio::main]
async fn main() {
    tracing_subscriber::fmt()
        .with_env_filter(
            tracing_subscriber::EnvFilter::from_default_env()
                .add_directive("info".parse().expect("a directive")),
        )
        .init();
    let args = Args::parse();
    let settings = Settings {
        socket: args.nri_socket,
        name: args.name,
        index: args.index,
        injection: Injection { bundle: args.bundle, endpoint_dir: args.endpoint_dir },
    };
    let stasisd = Arc::new(Api { socket: args.stasis_socket, cri_socket: args.cri_socket });
    loop {
        if let Err(e) = plugin::run(&settings, stasisd.clone()).await {
            warn!(error = format!("{:#}", anyhow::Error::from(e)), "NRI session ended; connecting again");
        }
        tokio::time::sleep(RECONNECT).await;
    }
}
