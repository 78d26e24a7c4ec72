//! `stasis spot` and `stasis evacuate`: which workloads a preemption notice evicts, and an
//! evacuation by hand (from a drain script, or a termination handler stasisd does not know).

use stasis_proto::stasis::v1::{EvacuateRequest, Evacuation, SetSpotRequest};

use crate::args::{EvacuateArgs, SpotArgs};
use crate::client::Client;
use crate::output;

pub async fn spot(client: &mut Client, args: SpotArgs) -> anyhow::Result<()> {
    let request = SetSpotRequest { workload: args.workload.clone(), on: args.on };
    client.rpc.set_spot(request).await.map_err(|s| client.error(s))?;
    match args.on {
        true => output::print(&format!("{} is evicted on a preemption notice", args.workload)),
        false => output::print(&format!("{} is left alone on a preemption notice", args.workload)),
    }
}

pub async fn run(client: &mut Client, args: EvacuateArgs) -> anyhow::Result<()> {
    let request = EvacuateRequest {
        within_ms: args.within.as_millis() as u64,
        leave_running: args.leave_running,
        cause: String::new(),
    };
    let response = client.rpc.evacuate(request).await.map_err(|s| client.error(s))?.into_inner();
    if args.json {
        return output::print_json(&response);
    }
    if response.workloads.is_empty() {
        return output::print("no spot workloads to evacuate");
    }
    let rows = response.workloads.iter().map(|e| {
        [
            e.workload.clone(),
            outcome(e),
            e.checkpoint.clone(),
            format!("{:.1}s", e.estimate_ms as f64 / 1000.0),
        ]
    });
    output::print(&output::table(["WORKLOAD", "RESULT", "CHECKPOINT", "ESTIMATE"], rows))?;
    let failed = response.workloads.iter().filter(|e| e.checkpoint.is_empty()).count();
    if failed > 0 {
        anyhow::bail!("{failed} of {} workloads are not durable", response.workloads.len());
    }
    Ok(())
}

/// "durable after 4.2s (25.8s to spare)", "durable 1.3s late", "failed: why".
pub fn outcome(e: &Evacuation) -> String {
    if e.checkpoint.is_empty() {
        return format!("failed: {}", e.error);
    }
    let secs = |ms: i64| format!("{:.1}s", ms as f64 / 1000.0);
    let after = secs(e.durable_unix_ms as i64 - e.notice_unix_ms as i64);
    let spare = e.deadline_unix_ms as i64 - e.durable_unix_ms as i64;
    match spare >= 0 {
        true => format!("durable after {after} ({} to spare)", secs(spare)),
        false => format!("durable after {after}, {} late", secs(-spare)),
    }
}
