//! `stasis status`: the daemon's version, configuration and workloads.

use stasis_proto::stasis::v1::{StatusRequest, StatusResponse};

use crate::args::StatusArgs;
use crate::client::Client;
use crate::output;

pub async fn run(client: &mut Client, args: StatusArgs) -> anyhow::Result<()> {
    let status = client.rpc.status(StatusRequest {}).await.map_err(|s| client.error(s))?.into_inner();
    if args.json { output::print_json(&status) } else { output::print(&describe(&status)) }
}

/// `key: value` lines, then one line per workload.
fn describe(s: &StatusResponse) -> String {
    let mut lines = vec![
        format!("daemon version: {}", s.daemon_version),
        format!("criu: {} ({})", s.criu_version, s.criu_path),
        format!("kernel: {}", s.kernel),
        format!("gpu support: {}", s.gpu_support),
        format!("sockets: {}", s.socket_support),
        format!("network lock: {}", s.network_lock),
        format!("store: {}", s.store_url),
        format!("state dir: {}", s.state_dir),
        format!("workloads: {}", s.workloads.len()),
    ];
    for w in &s.workloads {
        let state = if w.running { "running" } else { "exited" };
        lines.push(format!("  {} pid {} {state}: {}", w.name, w.pid, w.command.join(" ")));
        if !w.last_error.is_empty() {
            lines.push(format!("    last restore failed: {}", w.last_error));
        }
    }
    lines.join("\n")
}
