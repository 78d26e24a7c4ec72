//! `stasis restore`: restore a checkpoint, showing progress.

use stasis_proto::stasis::v1::{RestoreRequest, restore_event::Event, restore_request::Target};

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
    let request = RestoreRequest { target: Some(target), gpu_map: args.gpu_map };
    let stream = client.rpc.restore(request).await.map_err(|s| client.error(s))?.into_inner();
    let result = follow(client, stream, args.json, |e| match e.event? {
        Event::Progress(p) => Some(Step::Progress(p)),
        Event::Done(r) => Some(Step::Done(r)),
    })
    .await?;
    if args.json {
        return output::print_json(&output::restore_result(&result));
    }
    let restore_ms = result.stats.map_or(0, |s| s.restore_ms);
    output::print(&format!("restored {} as pid {} in {} ms", result.id, result.pid, restore_ms))
}
