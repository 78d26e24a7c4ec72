//! `stasis check`: verify the store, and say which checkpoints any damage breaks.

use anyhow::bail;
use stasis_proto::stasis::v1::{CheckRequest, CheckResponse};

use crate::args::CheckArgs;
use crate::client::Client;
use crate::output;

pub async fn run(client: &mut Client, args: CheckArgs) -> anyhow::Result<()> {
    let request = CheckRequest { read_data: args.read_data };
    let report = client.rpc.check(request).await.map_err(|s| client.error(s))?.into_inner();
    if args.json {
        output::print_json(&report)?;
    } else {
        output::print(&describe(&report, args.read_data))?;
    }
    if !report.problems.is_empty() {
        bail!(
            "the store has {} problem(s); {} checkpoint(s) cannot be restored whole",
            report.problems.len(),
            report.broken.len()
        );
    }
    Ok(())
}

/// " (zstd 120, raw 40)": the chunks read by codec, most first.
fn by_codec(r: &CheckResponse) -> String {
    let mut counts: Vec<(&String, &u64)> = r.chunks_by_codec.iter().collect();
    if counts.is_empty() {
        return String::new();
    }
    counts.sort_by(|a, b| b.1.cmp(a.1).then(a.0.cmp(b.0)));
    let listed: Vec<String> = counts.iter().map(|(codec, n)| format!("{codec} {n}")).collect();
    format!(" ({})", listed.join(", "))
}

fn describe(r: &CheckResponse, read_data: bool) -> String {
    let mut lines = vec![format!(
        "checked {} checkpoints, {} packs{}",
        r.manifests,
        r.packs,
        if read_data {
            format!(", {} chunks read and verified{}", r.chunks_read, by_codec(r))
        } else {
            String::new()
        }
    )];
    lines.extend(r.problems.iter().map(|p| format!("problem: {p}")));
    for b in &r.broken {
        lines.push(format!("broken: checkpoint {}: {}", b.id, b.reasons.join("; ")));
    }
    lines.extend(r.notes.iter().map(|n| format!("note: {n}")));
    if r.problems.is_empty() {
        lines.push("no problems found".into());
    }
    lines.join("\n")
}
