//! Idle reclaim: a workload nobody uses gives its memory (and GPU) back, and comes back on
//! its next use.
//!
//! ```text
//! monitor, every tick: CPU time and bytes read by each workload with an idle policy
//!   (activity.rs) -> idle for its whole period -> reclaim (reclaim.rs): an eviction
//!   checkpoint; used meanwhile -> the tree is given back instead of stopped
//! reclaimed: stasisd listens on the workload's ports and watches its locked connections
//!   (wake.rs) -> first connection, data, or `stasis wake` -> lazy restore -> the first
//!   connections are relayed to the restored listeners; later ones reach it directly
//! ```

mod activity;
mod in_use;
mod reclaim;
#[cfg(test)]
mod tests;
mod uses;
mod wake;

use std::net::SocketAddr;
use std::sync::{Arc, Weak};
use std::time::{Duration, Instant};

use serde::{Deserialize, Serialize};
use tracing::{info, warn};

use activity::IdleClock;
pub use activity::{GpuActivity, GpuWatch, Thresholds};
pub use in_use::ReclaimUses;

use super::slots::Slot;
use super::{Caller, Engine, PolicyError, Workload};

/// A reclaimed workload: what waking it needs.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct Reclaimed {
    /// The eviction checkpoint it is restored from.
    pub checkpoint: String,
    pub since_unix_ms: u64,
    /// Its listening TCP sockets: stasisd listens there while it is reclaimed.
    pub listeners: Vec<SocketAddr>,
    /// Local ports of its sockets (listeners and connections): a segment to one of them that
    /// carries data, opens or closes a connection wakes it.
    pub ports: Vec<u16>,
    /// Its established TCP connections, `(local, remote)`: a peer on this node that writes to
    /// one of them, or closes it, wakes it.
    #[serde(default)]
    pub connections: Vec<(SocketAddr, SocketAddr)>,
}

/// How idleness is measured.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct IdleSettings {
    pub thresholds: Thresholds,
    /// How often workloads are sampled.
    pub tick: Duration,
}

impl Default for IdleSettings {
    fn default() -> Self {
        IdleSettings { thresholds: Thresholds::default(), tick: Duration::from_secs(1) }
    }
}

/// Where a workload stands with idle reclaim, for `stasis status`.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum IdleState {
    /// Running, idle for this long (as of the last tick).
    Watched(Duration),
    Reclaiming,
    Reclaimed,
    Waking,
    /// No idle policy, or not running.
    Unwatched,
}

/// Where one workload stands with idle reclaim: its part of the workload's slot (see
/// `slots.rs`).
#[derive(Default)]
pub(super) struct IdleSlot {
    /// Since when it is idle; kept while it runs with an idle policy.
    clock: Option<IdleClock>,
    reclaiming: bool,
    waking: bool,
    /// What waits for its next use while it is reclaimed.
    waker: Option<wake::Waker>,
}

impl IdleSlot {
    pub(super) fn is_empty(&self) -> bool {
        self.clock.is_none() && !self.reclaiming && !self.waking && self.waker.is_none()
    }

    /// The workload was used just now (started, restored or woken): its idle time starts over.
    fn restart_clock(&mut self) {
        self.clock = Some(IdleClock::new(Instant::now()));
    }
}

impl Engine {
    /// Sets (or, with `None`, removes) the idle period after which `name` is reclaimed.
    pub fn set_idle(&self, name: &str, after: Option<Duration>, caller: Caller) -> Result<(), PolicyError> {
        self.own_workload(name, caller)?;
        let after_ms = after.map(|d| d.as_millis() as u64);
        self.registry.update(name, |w| w.idle_after_ms = after_ms).map_err(PolicyError::Registry)?;
        self.workloads.with(name, |slot| slot.idle.restart_clock());
        info!(workload = name, idle_after_ms = ?after_ms, "idle policy set");
        Ok(())
    }

    /// Workload `name`, if `caller` may act on it.
    pub(super) fn own_workload(&self, name: &str, caller: Caller) -> Result<super::Workload, PolicyError> {
        let w = self.registry.get(name).ok_or_else(|| PolicyError::UnknownWorkload(name.into()))?;
        if !caller.owns(w.owner_uid) {
            return Err(PolicyError::NotYours(name.into()));
        }
        Ok(w)
    }

    /// Where workload `w` stands with idle reclaim.
    pub fn idle_state(&self, w: &Workload) -> IdleState {
        let now = Instant::now();
        let seen = |slot: &Slot| {
            (slot.idle.waking, slot.idle.reclaiming, slot.idle.clock.as_ref().map(|c| c.idle_for(now)))
        };
        match self.workloads.read(&w.name, seen).unwrap_or_default() {
            (true, _, _) => IdleState::Waking,
            _ if w.reclaimed.is_some() => IdleState::Reclaimed,
            (_, true, _) => IdleState::Reclaiming,
            (_, _, Some(idle)) => IdleState::Watched(idle),
            (_, _, None) => IdleState::Unwatched,
        }
    }

    /// Starts the monitor (idle reclaim and periodic checkpoints, every tick), and a waker for
    /// every workload a previous run left reclaimed. Both end with the engine.
    pub(super) fn start_monitor(self: &Arc<Self>) {
        for w in self.registry.all() {
            if let Some(reclaimed) = w.reclaimed {
                info!(workload = %w.name, checkpoint = %reclaimed.checkpoint, "workload still reclaimed; waiting for its use");
                self.arm_waker(&w.name, reclaimed, None);
            }
        }
        let engine = Arc::downgrade(self);
        let tick = self.settings.idle.tick;
        tokio::spawn(async move {
            loop {
                tokio::time::sleep(tick).await;
                let Some(engine) = Weak::upgrade(&engine) else { return };
                if engine.jobs.is_closed() {
                    return;
                }
                let workloads = engine.registry.all();
                engine.idle_tick(&workloads);
                engine.periodic_tick(&workloads);
            }
        });
    }

    /// Samples every watched workload; starts the reclaim of those idle long enough.
    pub(super) fn idle_tick(self: &Arc<Self>, workloads: &[Workload]) {
        let limits = self.settings.idle.thresholds;
        let mut gpu_active = None;
        for w in workloads {
            let watched =
                w.idle_after_ms.filter(|_| w.reclaimed.is_none() && self.deps.host.is_running(w.pid));
            let Some(after_ms) = watched else {
                self.workloads.with(&w.name, |slot| slot.idle.clock = None);
                continue;
            };
            let gpu_active = gpu_active.get_or_insert_with(|| {
                let tick = self.settings.idle.tick;
                self.deps.gpu_activity.as_ref().map(|gpu| gpu.active(tick)).unwrap_or_default()
            });
            let sample =
                activity::sample(self.deps.host.as_ref(), &self.deps.host.trees(&[w.pid]), gpu_active);
            let reclaim = self.workloads.with(&w.name, |slot| {
                let idle =
                    slot.idle.clock.get_or_insert_with(|| IdleClock::new(sample.at)).observe(sample, limits);
                let due = idle >= Duration::from_millis(after_ms);
                // Not twice at once.
                (due && !std::mem::replace(&mut slot.idle.reclaiming, true)).then_some(idle)
            });
            let Some(idle) = reclaim else { continue };
            info!(workload = %w.name, idle_ms = idle.as_millis() as u64, "workload idle; reclaiming it");
            let (engine, name) = (self.clone(), w.name.clone());
            self.jobs.spawn(async move {
                let outcome = match engine.reclaim(&name).await {
                    Ok(Some(_)) => "reclaimed",
                    Ok(None) => "used",
                    Err(e) => {
                        warn!(workload = %name, error = %crate::error_chain(&e), "reclaim failed; the workload runs on");
                        "failed"
                    }
                };
                engine.metrics.reclaim(outcome);
                engine.workloads.with(&name, |slot| {
                    slot.idle.reclaiming = false;
                    slot.idle.restart_clock();
                });
            });
        }
    }
}
