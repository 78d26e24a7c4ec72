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
mod reclaim;
#[cfg(test)]
mod tests;
mod uses;
mod wake;

use std::collections::{HashMap, HashSet};
use std::net::SocketAddr;
use std::sync::{Arc, Mutex, Weak};
use std::time::{Duration, Instant};

use serde::{Deserialize, Serialize};
use tracing::{info, warn};

use activity::IdleClock;
pub use activity::{GpuActivity, Thresholds};

use super::{Caller, Engine, PolicyError, Workload, lock};

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

/// The idle monitor's bookkeeping.
#[derive(Default)]
pub(super) struct IdleBook {
    clocks: Mutex<HashMap<String, IdleClock>>,
    reclaiming: Mutex<HashSet<String>>,
    waking: Mutex<HashSet<String>>,
    wakers: Mutex<HashMap<String, wake::Waker>>,
    /// When GPU activity was last asked for (microseconds since the epoch).
    gpu_asked_us: Mutex<Option<u64>>,
}

impl IdleBook {
    /// The workload was used just now (started, restored, woken): its idle time starts over.
    fn restart_clock(&self, name: &str) {
        lock(&self.clocks).insert(name.to_owned(), IdleClock::new(Instant::now()));
    }
}

impl Engine {
    /// Sets (or, with `None`, removes) the idle period after which `name` is reclaimed.
    pub fn set_idle(&self, name: &str, after: Option<Duration>, caller: Caller) -> Result<(), PolicyError> {
        self.own_workload(name, caller)?;
        let after_ms = after.map(|d| d.as_millis() as u64);
        self.registry.update(name, |w| w.idle_after_ms = after_ms).map_err(PolicyError::Registry)?;
        self.idle.restart_clock(name);
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
        let name = w.name.as_str();
        if lock(&self.idle.waking).contains(name) {
            IdleState::Waking
        } else if w.reclaimed.is_some() {
            IdleState::Reclaimed
        } else if lock(&self.idle.reclaiming).contains(name) {
            IdleState::Reclaiming
        } else {
            match lock(&self.idle.clocks).get(name) {
                Some(clock) => IdleState::Watched(clock.idle_for(Instant::now())),
                None => IdleState::Unwatched,
            }
        }
    }

    /// Starts the monitor (idle reclaim and periodic checkpoints, every tick), and a waker for
    /// every workload a previous run left reclaimed. Both end with the engine.
    pub(super) fn start_monitor(self: &Arc<Self>) {
        for w in self.registry.all() {
            if let Some(reclaimed) = w.reclaimed {
                info!(workload = %w.name, checkpoint = %reclaimed.checkpoint, "workload still reclaimed; waiting for its use");
                self.arm_waker(&w.name, reclaimed);
            }
        }
        let engine = Arc::downgrade(self);
        let tick = self.idle_settings.tick;
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

    /// The processes that used a GPU since the last tick (none without NVML).
    fn gpu_active(&self) -> HashSet<u32> {
        let Some(gpu) = &self.gpu_activity else { return HashSet::new() };
        let now_us = super::now_unix_ms() * 1000;
        let tick_us = self.idle_settings.tick.as_micros() as u64;
        let since = lock(&self.idle.gpu_asked_us).replace(now_us).unwrap_or(now_us.saturating_sub(tick_us));
        gpu.active_since(since).unwrap_or_else(|why| {
            warn!(reason = %why, "cannot read GPU activity; idle workloads are judged by CPU and reads");
            HashSet::new()
        })
    }

    /// Samples every watched workload; starts the reclaim of those idle long enough.
    fn idle_tick(self: &Arc<Self>, workloads: &[Workload]) {
        let limits = self.idle_settings.thresholds;
        let mut gpu_active = None;
        for w in workloads {
            let watched = w.idle_after_ms.filter(|_| w.reclaimed.is_none() && self.host.is_running(w.pid));
            let Some(after_ms) = watched else {
                lock(&self.idle.clocks).remove(&w.name);
                continue;
            };
            let gpu_active = gpu_active.get_or_insert_with(|| self.gpu_active());
            let sample = activity::sample(self.host.as_ref(), &self.host.trees(&[w.pid]), gpu_active);
            let idle = lock(&self.idle.clocks)
                .entry(w.name.clone())
                .or_insert_with(|| IdleClock::new(sample.at))
                .observe(sample, limits);
            if idle < Duration::from_millis(after_ms) || !lock(&self.idle.reclaiming).insert(w.name.clone()) {
                continue;
            }
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
                lock(&engine.idle.reclaiming).remove(&name);
                engine.idle.restart_clock(&name);
            });
        }
    }
}
