//! stasis-webhook's command line.
#![forbid(unsafe_code)]

use std::net::SocketAddr;
use std::path::PathBuf;

use anyhow::Context;
use clap::Parser;
use stasis_webhook::mutate::Sizing;
use stasis_webhook::server;

#[derive(Debug, Parser)]
#[command(version, about)]
struct Args {
    #[arg(long, default_value = "0.0.0.0:8443")]
    listen: SocketAddr,
    /// The TLS certificate (PEM, with its chain) and key, as the secret mounts them.
    #[arg(long, default_value = "/etc/stasis-webhook/tls.crt")]
    tls_cert: PathBuf,
    #[arg(long, default_value = "/etc/stasis-webhook/tls.key")]
    tls_key: PathBuf,
    /// MB/s the nodes' store takes (what `stasis checkpoint` reports as bytes_uploaded over
    /// durable time); the grace period is sized by it.
    #[arg(long, default_value_t = 200)]
    store_mb_per_sec: u64,
    /// Device memory per GPU, in GiB.
    #[arg(long, default_value_t = 80)]
    gpu_memory_gib: u64,
    /// Seconds the grace period gets besides the upload.
    #[arg(long, default_value_t = 30)]
    margin_secs: u64,
}

#[tokio::main]
async fn main() -> anyhow::Result<()> {
    tracing_subscriber::fmt()
        .with_env_filter(tracing_subscriber::EnvFilter::from_default_env().add_directive("info".parse()?))
        .init();
    let args = Args::parse();
    let sizing = Sizing {
        store_bytes_per_sec: args.store_mb_per_sec * 1_000_000,
        gpu_memory_bytes: args.gpu_memory_gib << 30,
        margin_secs: args.margin_secs,
    };
    let acceptor = server::tls(&args.tls_cert, &args.tls_key).context("loading the TLS certificate")?;
    server::serve(args.listen, acceptor, sizing).await.context("serving")
}
