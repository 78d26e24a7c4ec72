//! `stasis idle` and `stasis wake`: a workload's idle reclaim period, and waking it by hand.

use stasis_proto::stasis::v1::{SetIdleRequest, WakeRequest};

use crate::args::{IdleArgs, WakeArgs};
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
