//! `stasis status`: the daemon's version, configuration and workloads.

use stasis_proto::stasis::v1::{StatusRequest, StatusResponse, WorkloadStatus};

use crate::args::StatusArgs;
use crate::client::Client;
use crate::output;

pub async fn run(client: &mut Client, args: StatusArgs) -> anyhow::Result<()> {
    let status = client.rpc.status(StatusRequest {}).await.map_err(|s| client.error(s))?.into_inner();
    if args.json { output::print_json(&status) } else { output::print(&describe(&status)) }
}

/// "running, idle 12s of 30s", "reclaimed (checkpoint ...)", "exited".
fn workload_state(w: &WorkloadStatus) -> String {
    let secs = |ms: u64| format!("{}s", ms / 1000);
    match (w.state.as_str(), w.idle_after_ms) {
        ("running", 0) => "running".into(),
        ("running", after) => format!("running, idle {} of {}", secs(w.idle_ms), secs(after)),
        ("reclaimed", _) => format!("reclaimed (checkpoint {}; woken on use)", w.reclaimed_checkpoint),
        ("stopped", _) | ("", _) if !w.running => "exited".into(),
        (state, _) => state.into(),
    }
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
        format!("memory tracking: {}", s.memory_tracking),
        format!("preemption notices: {}", s.notices),
        format!("store: {}", s.store_url),
        format!("compression: {}", s.compression),
        format!("state dir: {}", s.state_dir),
        format!("workloads: {}", s.workloads.len()),
    ];
    for w in &s.workloads {
        lines.push(format!("  {} pid {} {}: {}", w.name, w.pid, workload_state(w), w.command.join(" ")));
        if w.checkpoint_every_ms > 0 {
            let last = if w.last_checkpoint.is_empty() { "none yet" } else { w.last_checkpoint.as_str() };
            let every = match w.fitted_every_ms {
                0 => format!("every {}s", w.checkpoint_every_ms / 1000),
                fitted => format!(
                    "every {}s (set: {}s; shortened to fit the notice window)",
                    fitted / 1000,
                    w.checkpoint_every_ms / 1000
                ),
            };
            lines.push(format!("    checkpointed {every}, last {last}"));
        }
        if w.spot {
            lines.push("    evicted on a preemption notice".into());
        }
        if let Some(e) = &w.evacuation {
            lines.push(format!("    last evacuation ({}): {}", e.cause, super::evacuate::outcome(e)));
        }
        if !w.last_error.is_empty() {
            lines.push(format!("    last restore failed: {}", w.last_error));
        }
    }
    lines.join("\n")
}
