//! `stasis`: the command line for stasisd, the checkpoint/restore daemon.
#![forbid(unsafe_code)]

mod args;
mod client;
mod commands;
mod output;
mod progress;

use std::process::ExitCode;

use anyhow::Context as _;
use clap::Parser as _;

fn main() -> ExitCode {
    match main_exec() {
        Ok(()) => ExitCode::SUCCESS,
        Err(err) => {
            eprintln!("error: {err:#}");
            ExitCode::FAILURE
        }
    }
}

fn main_exec() -> anyhow::Result<()> {
    let cli = args::Cli::parse();
    let runtime = tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .build()
        .context("starting the async runtime")?;
    runtime.block_on(commands::execute(&cli.socket, cli.command))
}
