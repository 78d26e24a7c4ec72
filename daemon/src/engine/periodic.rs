//! Periodic checkpoints (`stasis run --checkpoint-every`, `stasis periodic`): incremental
//! `--leave-running` checkpoints of a workload at a fixed interval, so that losing the node costs
//! at most an interval's work, and an eviction's final checkpoint has little left to store.
//!
//! The idle monitor's tick drives them: a workload whose interval has passed since its last
//! periodic checkpoint started gets the next one, unless one is still under way.

use std::collections::{HashMap, HashSet};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use tracing::{info, warn};

use super::{Caller, CheckpointParams, Engine, PolicyError, Target, Workload, lock};

/// When each workload's last periodic checkpoint started, which are under way, and whose
/// interval is shortened to fit the notice window.
#[derive(Debug, Default)]
pub(super) struct Schedule {
    last: Mutex<HashMap<String, Instant>>,
    running: Mutex<HashSet<String>>,
    pub(super) fitted: Mutex<HashMap<String, Duration>>,
}

impl Engine {
    /// Sets (or, with `None`, stops) the periodic checkpoints of `name`.
    pub fn set_periodic(
        &self,
        name: &str,
        every: Option<Duration>,
        caller: Caller,
    ) -> Result<(), PolicyError> {
        self.own_workload(name, caller)?;
        let every_ms = every.map(|d| d.as_millis() as u64);
        self.registry.update(name, |w| w.checkpoint_every_ms = every_ms).map_err(PolicyError::Registry)?;
        lock(&self.schedule.last).insert(name.to_owned(), Instant::now());
        info!(workload = name, checkpoint_every_ms = ?every_ms, "periodic checkpoints set");
        Ok(())
    }

    /// Starts the periodic checkpoints that are due.
    pub(super) fn periodic_tick(self: &Arc<Self>, workloads: &[Workload]) {
        if self.is_evacuating() {
            // The evictions come first; a periodic checkpoint would only hold one up.
            return;
        }
        let now = Instant::now();
        let spot = workloads.iter().filter(|w| w.spot).count();
        for w in workloads {
            let due = w.checkpoint_every_ms.filter(|_| w.reclaimed.is_none() && self.tree_runs(w));
            let Some(every_ms) = due else {
                lock(&self.schedule.last).remove(&w.name);
                lock(&self.schedule.fitted).remove(&w.name);
                continue;
            };
            let every = self.fitted_interval(w, Duration::from_millis(every_ms), spot);
            let started = *lock(&self.schedule.last).entry(w.name.clone()).or_insert(now);
            if now.duration_since(started) < every || !lock(&self.schedule.running).insert(w.name.clone()) {
                continue;
            }
            lock(&self.schedule.last).insert(w.name.clone(), now);
            let (engine, name) = (self.clone(), w.name.clone());
            self.jobs.spawn(async move {
                let params = CheckpointParams {
                    target: Target::Workload(name.clone()),
                    leave_running: true,
                    answer_early: None,
                    reclaim: None,
                    caller: Caller::Root,
                };
                match engine.checkpoint(params, Arc::new(|_| {})).await {
                    Ok(o) => info!(workload = %name, checkpoint = %o.id, "periodic checkpoint stored"),
                    Err(e) => warn!(workload = %name, error = %crate::error_chain(&e), "periodic checkpoint failed; the next is due after the interval"),
                }
                lock(&engine.schedule.running).remove(&name);
            });
        }
    }
}
