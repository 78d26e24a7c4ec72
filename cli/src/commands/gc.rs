//! `stasis gc`: apply retention and reclaim unreferenced store space.

use bytesize::ByteSize;
use stasis_proto::stasis::v1::GcRequest;

use crate::args::GcArgs;
use crate::client::Client;
use crate::output;

pub async fn run(client: &mut Client, args: GcArgs) -> anyhow::Result<()> {
    let request = GcRequest { keep_last: args.keep_last.unwrap_or(0) };
    let response = client.rpc.gc(request).await.map_err(|s| client.error(s))?.into_inner();
    if args.json {
        return output::print_json(&response);
    }
    for pack in &response.damaged_packs {
        eprintln!(
            "warning: pack {pack} is damaged (its index cannot be read, or a chunk a checkpoint needs \
             does not check out); the pack was kept: `stasis check --read-data` names what it breaks"
        );
    }
    output::print(&format!(
        "deleted {} checkpoints, {} packs, repacked {}; freed {}",
        response.checkpoints_deleted.len(),
        response.packs_deleted,
        response.packs_repacked,
        ByteSize(response.bytes_freed)
    ))
}
