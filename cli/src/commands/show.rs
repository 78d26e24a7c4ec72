//! `stasis show`: the details of one checkpoint.

use bytesize::ByteSize;
use stasis_proto::stasis::v1::{CheckpointInfo, ShowRequest};

use crate::args::ShowArgs;
use crate::client::Client;
use crate::output;

pub async fn run(client: &mut Client, args: ShowArgs) -> anyhow::Result<()> {
    let info = client.rpc.show(ShowRequest { id: args.id }).await.map_err(|s| client.error(s))?.into_inner();
    if args.json { output::print_json(&info) } else { output::print(&describe(&info)) }
}

/// `key: value` lines for a checkpoint.
fn describe(c: &CheckpointInfo) -> String {
    let pids: Vec<String> = c.pids.iter().map(i32::to_string).collect();
    let mut lines = vec![
        format!("id: {}", c.id),
        format!("workload: {}", c.workload),
        format!("pid: {}", c.pid),
        format!("created: {}", output::utc(c.created_unix_ms)),
        format!("size: {}", ByteSize(c.bytes_total)),
        format!("node: {}", c.node),
        format!("kernel: {}", c.kernel),
        format!("criu: {}", c.criu_version),
        format!("criu options: {}", c.criu_options.join(" ")),
        format!("command: {}", c.command.join(" ")),
        format!("pids: {}", pids.join(" ")),
    ];
    if !c.imported_from.is_empty() {
        lines.push(format!("imported from: {}", c.imported_from));
    }
    if let Some(s) = &c.stats {
        lines.push(format!(
            "timings: frozen {} ms, dump {} ms, store {} ms, total {} ms",
            s.frozen_ms, s.dump_ms, s.store_ms, s.total_ms
        ));
    }
    lines.push(format!("sockets: {}", c.sockets.len()));
    lines.extend(c.sockets.iter().map(|s| format!("  {s}")));
    lines.push(format!("files: {}", c.files.len()));
    lines.extend(c.files.iter().map(|f| format!("  {f}")));
    lines.join("\n")
}
