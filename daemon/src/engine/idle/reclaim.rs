//! Reclaiming an idle workload: an eviction checkpoint that backs off if the workload is used
//! while it runs.
//!
//! From the survey of its sockets until the checkpoint is durable, stasisd watches the
//! workload's ports. A request that arrives meanwhile (a new connection, or data on one the
//! dump locked), or one that came just before and that the stopped tree has not answered yet
//! (see `in_use.rs`), makes the job give the stored tree back instead of stopping it: the
//! request is answered, late by the checkpoint's time, rather than lost.

use std::net::SocketAddr;
use std::sync::Arc;
use std::sync::atomic::{AtomicBool, Ordering};

use stasis_proto::stasis::store::v1::SocketRecord;
use tracing::{info, warn};

use super::Reclaimed;
use super::in_use::{LEFT_UNREAD, ReclaimUses};
use super::uses::UseWatch;
use crate::engine::ids::now_unix_ms;
use crate::engine::{Caller, CheckpointError, CheckpointParams, Engine, Target};
use crate::linux::net::SocketKind;
use crate::linux::port_watch::MAX_PORTS;

impl Engine {
    /// Reclaims workload `name`; returns what waking it needs, or `None` when it was used
    /// during the reclaim and runs on.
    pub(super) async fn reclaim(self: &Arc<Self>, name: &str) -> Result<Option<Reclaimed>, CheckpointError> {
        let w = self.registry.get(name).ok_or_else(|| CheckpointError::UnknownWorkload(name.into()))?;
        let pids = self.deps.host.trees(&[w.pid]);
        let surveyed = self.deps.host.sockets(&pids);
        let WakePoints { listeners, ports, connections } = wake_points(&surveyed.records);
        let first = self.deps.host.waiting_input(&pids);
        let seen = Arc::new(AtomicBool::new(false));
        let mut watching = self.watch_uses(name, &ports, &connections, seen.clone());
        // What the program leaves untaken while it runs (see `in_use.rs`); the watch ends only
        // on a use, and then so does the wait.
        tokio::select! {
            _ = tokio::time::sleep(LEFT_UNREAD) => {}
            _ = &mut watching => {}
        }
        if seen.load(Ordering::SeqCst) {
            info!(workload = name, "the workload was used as its reclaim began; it runs on");
            return Ok(None);
        }
        let second = self.deps.host.waiting_input(&pids);
        let params = CheckpointParams {
            target: Target::Workload(name.into()),
            leave_running: false,
            answer_early: None,
            reclaim: Some(Arc::new(ReclaimUses::new(seen, &first, &second))),
            caller: Caller::Root,
        };
        let checkpointed = self.checkpoint(params, Arc::new(|_| {})).await;
        watching.abort();
        let outcome = checkpointed?;
        if outcome.left_running {
            info!(workload = name, checkpoint = %outcome.id, "the workload was used during its reclaim; it runs on");
            return Ok(None);
        }
        let reclaimed = Reclaimed {
            checkpoint: outcome.id.clone(),
            since_unix_ms: now_unix_ms(),
            listeners,
            ports,
            connections,
        };
        // Before the reclaim shows: a client that sees it may connect at once.
        let held = self.hold_until_listening(name, &reclaimed);
        if let Err(e) = self.registry.update(name, |w| w.reclaimed = Some(reclaimed.clone())) {
            warn!(workload = name, error = %e, "cannot record the reclaim in the registry; a restart forgets it");
        }
        info!(workload = name, checkpoint = %outcome.id, listeners = ?reclaimed.listeners, ports = ?reclaimed.ports, "workload reclaimed");
        self.arm_waker(name, reclaimed.clone(), held);
        Ok(Some(reclaimed))
    }

    /// Watches the uses of workload `name` (see [`UseWatch`]) until the first, then sets
    /// `seen`. Without a watch (no ports, no packet socket, no peers on this node) a reclaim
    /// cannot notice a request arriving meanwhile: the request then waits for the wake.
    fn watch_uses(
        &self,
        name: &str,
        ports: &[u16],
        connections: &[(SocketAddr, SocketAddr)],
        seen: Arc<AtomicBool>,
    ) -> tokio::task::JoinHandle<()> {
        let mut watch =
            UseWatch::open(self.deps.host.as_ref(), name, ports, connections, "during its reclaim");
        let name = name.to_owned();
        tokio::spawn(async move {
            let port = watch.next().await;
            info!(workload = %name, port, "the workload was used during its reclaim");
            seen.store(true, Ordering::SeqCst);
        })
    }
}

/// Where a reclaimed workload is woken.
#[derive(Debug, Default, PartialEq)]
struct WakePoints {
    /// The listening addresses (TCP, in this node's network namespace).
    listeners: Vec<SocketAddr>,
    /// The local ports of all its TCP sockets, at most [`MAX_PORTS`].
    ports: Vec<u16>,
    /// Its established connections to peers outside the tree, `(local, remote)`.
    connections: Vec<(SocketAddr, SocketAddr)>,
}

/// The wake points of a tree with sockets `records`.
fn wake_points(records: &[SocketRecord]) -> WakePoints {
    let tcp = records.iter().filter(|r| r.kind == SocketKind::Tcp.name() && !r.foreign_netns);
    let mut points = WakePoints::default();
    for r in tcp {
        let Ok(local) = r.local.parse::<SocketAddr>() else { continue };
        if r.state == "listen" && !points.listeners.contains(&local) {
            points.listeners.push(local);
        }
        if !points.ports.contains(&local.port()) && points.ports.len() < MAX_PORTS {
            points.ports.push(local.port());
        }
        if let (Ok(remote), "established", false) =
            (r.remote.parse::<SocketAddr>(), r.state.as_str(), r.peer_in_tree)
        {
            points.connections.push((local, remote));
        }
    }
    points
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::engine::sockets::record;

    #[test]
    fn listeners_and_every_local_port_wake() {
        let mut other_ns = record("tcp", "listen", "0.0.0.0:9000", "");
        other_ns.foreign_netns = true;
        let records = vec![
            record("tcp", "listen", "127.0.0.1:8888", ""),
            record("tcp", "established", "127.0.0.1:8888", "127.0.0.1:50000"),
            record("tcp", "established", "10.0.0.5:41000", "10.0.0.9:5432"),
            record("udp", "", "0.0.0.0:5353", ""),
            record("unix", "listen", "/run/x", ""),
            other_ns,
        ];
        let points = wake_points(&records);
        assert_eq!(points.listeners, vec!["127.0.0.1:8888".parse::<SocketAddr>().unwrap()]);
        assert_eq!(points.ports, vec![8888, 41000]);
        let addr = |a: &str| a.parse::<SocketAddr>().unwrap();
        assert_eq!(
            points.connections,
            vec![
                (addr("127.0.0.1:8888"), addr("127.0.0.1:50000")),
                (addr("10.0.0.5:41000"), addr("10.0.0.9:5432"))
            ]
        );
    }
}
