//! `stasis restore`: restore a checkpoint, showing progress.

use bytesize::ByteSize;
use stasis_proto::stasis::v1::{
    RestoreRequest, RestoreResult, RestoreStats, restore_event::Event, restore_request::Target,
};

use super::{Step, follow};
use crate::args::RestoreArgs;
use crate::client::Client;
use crate::output;

pub async fn run(client: &mut Client, args: RestoreArgs) -> anyhow::Result<()> {
    // clap guarantees exactly one of the two.
    let target = match (args.checkpoint_id, args.workload) {
        (Some(id), _) => Target::CheckpointId(id),
        (None, workload) => Target::Workload(workload.unwrap_or_default()),
    };
    let request = RestoreRequest {
        target: Some(target),
        gpu_map: args.gpu_map,
        lazy: args.lazy,
        tcp_close: args.tcp_close,
        as_workload: args.as_workload.unwrap_or_default(),
    };
    let stream = client.rpc.restore(request).await.map_err(|s| client.error(s))?.into_inner();
    let (json, no_wait) = (args.json, args.no_wait);
    let result = follow(client, stream, json, |e| match e.event? {
        Event::Progress(p) => Some(Step::Progress(p)),
        Event::Done(r) => Some(Step::Done(r)),
        // The tree runs; its memory is still arriving.
        Event::Running(r) if no_wait => Some(Step::Done(RestoreResult {
            id: r.id,
            workload: r.workload,
            pid: r.pid,
            stats: Some(RestoreStats { first_run_ms: r.first_run_ms, lazy: true, ..Default::default() }),
            warnings: r.warnings,
        })),
        Event::Running(r) => {
            if !json {
                eprintln!("running as pid {} after {} ms; memory still arriving", r.pid, r.first_run_ms);
            }
            None
        }
    })
    .await?;
    if json {
        return output::print_json(&result);
    }
    for warning in &result.warnings {
        eprintln!("warning: {warning}");
    }
    let s = result.stats.unwrap_or_default();
    let line = match (s.lazy, s.resident_ms) {
        (false, _) => format!("restored {} as pid {} in {} ms", result.id, result.pid, s.restore_ms),
        (true, 0) => format!(
            "restored {} as pid {}: running after {} ms, memory still arriving",
            result.id, result.pid, s.first_run_ms
        ),
        (true, resident) => format!(
            "restored {} as pid {}: running after {} ms, all memory in after {} ms ({} fetched)",
            result.id,
            result.pid,
            s.first_run_ms,
            resident,
            ByteSize(s.bytes_fetched)
        ),
    };
    output::print(&line)
}
