//! `stasis checkpoint`: checkpoint a process tree, showing progress.

use bytesize::ByteSize;
use stasis_proto::stasis::v1::{CheckpointRequest, checkpoint_event::Event, checkpoint_request::Target};

use super::{Step, follow};
use crate::args::CheckpointArgs;
use crate::client::Client;
use crate::output;

pub async fn run(client: &mut Client, args: CheckpointArgs) -> anyhow::Result<()> {
    // clap guarantees exactly one of the two.
    let target = match (args.pid, args.workload) {
        (Some(pid), _) => Target::Pid(pid),
        (None, workload) => Target::Workload(workload.unwrap_or_default()),
    };
    let request =
        CheckpointRequest { target: Some(target), leave_running: args.leave_running, no_wait: args.no_wait };
    let stream = client.rpc.checkpoint(request).await.map_err(|s| client.error(s))?.into_inner();
    let result = follow(client, stream, args.json, |e| match e.event? {
        Event::Progress(p) => Some(Step::Progress(p)),
        Event::Done(r) => Some(Step::Done(r)),
    })
    .await?;
    if args.json {
        return output::print_json(&result);
    }
    let stats = result.stats.unwrap_or_default();
    if !result.durable {
        return output::print(&format!(
            "checkpoint {} of workload {} (pid {}): frozen {} ms; still being stored",
            result.id, result.workload, result.pid, stats.frozen_ms
        ));
    }
    output::print(&format!(
        "checkpoint {} of workload {} (pid {}): {}, frozen {} ms, total {} ms",
        result.id,
        result.workload,
        result.pid,
        ByteSize(stats.bytes_total),
        stats.frozen_ms,
        stats.total_ms
    ))
}
