//! `stasis export` and `stasis import`: checkpoints out to, and in from, container checkpoint
//! archives. stasisd reads and writes the file, so its path is made absolute here.

use std::path::Path;

use anyhow::Context;
use bytesize::ByteSize;
use stasis_proto::stasis::v1::{ExportRequest, ImportRequest};

use crate::args::{ExportArgs, ImportArgs};
use crate::client::Client;
use crate::output;

pub async fn export(client: &mut Client, args: ExportArgs) -> anyhow::Result<()> {
    let request = ExportRequest { id: args.id, path: absolute(&args.output)?, compression: args.compress };
    let response = client.rpc.export(request).await.map_err(|s| client.error(s))?.into_inner();
    if args.json {
        return output::print_json(&response);
    }
    output::print(&format!(
        "exported {} to {} ({}, {} entries)",
        response.id,
        response.path,
        ByteSize(response.bytes),
        response.files.len()
    ))
}

pub async fn import(client: &mut Client, args: ImportArgs) -> anyhow::Result<()> {
    let request =
        ImportRequest { path: absolute(&args.archive)?, workload: args.workload.unwrap_or_default() };
    let response = client.rpc.import(request).await.map_err(|s| client.error(s))?.into_inner();
    if args.json {
        return output::print_json(&response);
    }
    output::print(&format!(
        "imported {} archive as checkpoint {} of workload {}: {} in {} files, {} new to the store\n\
         restore: {}",
        response.engine,
        response.id,
        response.workload,
        ByteSize(response.bytes_total),
        response.kept.len(),
        ByteSize(response.bytes_uploaded),
        response.restore
    ))
}

/// `path` made absolute against the current directory.
fn absolute(path: &Path) -> anyhow::Result<String> {
    let path = std::path::absolute(path).with_context(|| format!("cannot resolve {}", path.display()))?;
    path.into_os_string().into_string().map_err(|p| anyhow::anyhow!("{} is not UTF-8", p.display()))
}
