//! stasisd: parses its settings, sets up logging and runs the daemon.

#![forbid(unsafe_code)]

use anyhow::Context;
use clap::Parser;
use stasis_daemon::config::{Args, DaemonConfig, LogFormat};
use tracing_subscriber::EnvFilter;

fn main() -> anyhow::Result<()> {
    let config = DaemonConfig::resolve(Args::parse()).context("invalid configuration")?;
    let filter = EnvFilter::try_from_default_env().unwrap_or_else(|_| EnvFilter::new("info"));
    let logs = tracing_subscriber::fmt().with_env_filter(filter).with_writer(std::io::stderr);
    match config.log_format {
        LogFormat::Json => logs.json().init(),
        LogFormat::Text => logs.init(),
    }
    // Freed buffers are reused rather than unmapped (the server hands them back every 10 s).
    stasis_daemon::linux::sys::keep_freed_memory();
    let runtime = tokio::runtime::Runtime::new().context("cannot start the async runtime")?;
    runtime.block_on(stasis_daemon::server::serve(config)).context("stasisd failed")
}
