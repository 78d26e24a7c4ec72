//! `stasis idle`, `stasis wake` and `stasis periodic`: a workload's idle reclaim period, waking
//! it by hand, and its periodic checkpoints.

use stasis_proto::stasis::v1::{SetIdleRequest, SetPeriodicRequest, WakeRequest};

use crate::args::{IdleArgs, PeriodicArgs, WakeArgs};
use crate::client::Client;
use crate::output;

pub async fn set(client: &mut Client, args: IdleArgs) -> anyhow::Result<()> {
    let after_ms = args.after.filter(|_| !args.off).map(|d| d.as_millis() as u64).unwrap_or_default();
    let request = SetIdleRequest { workload: args.workload.clone(), after_ms };
    client.rpc.set_idle(request).await.map_err(|s| client.error(s))?;
    match args.after.filter(|_| !args.off) {
        Some(after) => output::print(&format!("{} is reclaimed after {after:?} idle", args.workload)),
        None => output::print(&format!("{} is never reclaimed", args.workload)),
    }
}

pub async fn wake(client: &mut Client, args: WakeArgs) -> anyhow::Result<()> {
    let request = WakeRequest { workload: args.workload };
    let woken = client.rpc.wake(request).await.map_err(|s| client.error(s))?.into_inner();
    if args.json {
        return output::print_json(&woken);
    }
    for warning in &woken.warnings {
        eprintln!("warning: {warning}");
    }
    output::print(&format!(
        "woke {} from {}: running as pid {} after {} ms, memory still arriving",
        woken.workload, woken.id, woken.pid, woken.first_run_ms
    ))
}

pub async fn periodic(client: &mut Client, args: PeriodicArgs) -> anyhow::Result<()> {
    let every = args.every.filter(|_| !args.off);
    let request = SetPeriodicRequest {
        workload: args.workload.clone(),
        every_ms: every.map(|d| d.as_millis() as u64).unwrap_or_default(),
    };
    client.rpc.set_periodic(request).await.map_err(|s| client.error(s))?;
    match every {
        Some(every) => output::print(&format!("{} is checkpointed every {every:?}", args.workload)),
        None => output::print(&format!("{} has no periodic checkpoints", args.workload)),
    }
}
