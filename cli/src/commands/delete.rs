//! `stasis delete`: delete a checkpoint.

use stasis_proto::stasis::v1::DeleteRequest;

use crate::args::DeleteArgs;
use crate::client::Client;
use crate::output;

pub async fn run(client: &mut Client, args: DeleteArgs) -> anyhow::Result<()> {
    let response =
        client.rpc.delete(DeleteRequest { id: args.id }).await.map_err(|s| client.error(s))?.into_inner();
    output::print(&format!("deleted {}", response.id))
}
