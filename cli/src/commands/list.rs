//! `stasis list`: list stored checkpoints.

use bytesize::ByteSize;
use stasis_proto::stasis::v1::ListRequest;

use crate::args::ListArgs;
use crate::client::Client;
use crate::output;

pub async fn run(client: &mut Client, args: ListArgs) -> anyhow::Result<()> {
    let request = ListRequest { workload: args.workload.unwrap_or_default() };
    let response = client.rpc.list(request).await.map_err(|s| client.error(s))?.into_inner();
    if args.json {
        return output::print_json(&response);
    }
    for damaged in &response.unreadable {
        eprintln!("warning: unreadable checkpoint {damaged}");
    }
    if response.checkpoints.is_empty() {
        return output::print("no checkpoints");
    }
    let rows = response.checkpoints.iter().map(|c| {
        [
            c.id.clone(),
            c.workload.clone(),
            c.pid.to_string(),
            output::utc(c.created_unix_ms),
            ByteSize(c.bytes_total).to_string(),
            c.node.clone(),
        ]
    });
    output::print(&output::table(["ID", "WORKLOAD", "PID", "CREATED", "SIZE", "NODE"], rows))
}
