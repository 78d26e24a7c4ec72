//! `stasis run`: start a command as a stasisd workload.

use anyhow::Context as _;
use stasis_proto::stasis::v1::RunRequest;

use crate::args::RunArgs;
use crate::client::Client;
use crate::output;

pub async fn run(client: &mut Client, args: RunArgs) -> anyhow::Result<()> {
    // The daemon has its own working directory, so a relative or missing --cwd is resolved
    // here, against the CLI's.
    let cwd = match args.cwd {
        Some(dir) => {
            std::path::absolute(&dir).with_context(|| format!("resolving --cwd {}", dir.display()))?
        }
        None => std::env::current_dir().context("reading the current directory")?,
    };
    let cwd = cwd
        .into_os_string()
        .into_string()
        .map_err(|dir| anyhow::anyhow!("working directory {} is not UTF-8", dir.display()))?;
    let request = RunRequest {
        workload: args.workload.unwrap_or_default(),
        argv: args.command,
        cwd,
        env: args.env,
        idle_after_ms: args.idle_after.map(|d| d.as_millis() as u64).unwrap_or_default(),
        checkpoint_every_ms: args.checkpoint_every.map(|d| d.as_millis() as u64).unwrap_or_default(),
        spot: args.spot,
        host_pids: args.host_pids,
        own_pids: args.own_pids,
    };
    let response = client.rpc.run(request).await.map_err(|s| client.error(s))?.into_inner();
    if args.json {
        output::print_json(&response)
    } else {
        output::print(&format!(
            "started workload {}, pid {} (log: {})",
            response.workload, response.pid, response.log_path
        ))
    }
}
