//! Periodic checkpoints (`stasis run --checkpoint-every`, `stasis periodic`): incremental
//! `--leave-running` checkpoints of a workload at a fixed interval, so that losing the node costs
//! at most an interval's work, and an eviction's final checkpoint has little left to store.
//!
//! The idle monitor's tick drives them: a workload whose interval has passed since its last
//! periodic checkpoint started gets the next one, unless one is still under way.

use std::sync::Arc;
use std::time::{Duration, Instant};

use tracing::{info, warn};

use super::{Caller, CheckpointParams, Engine, PolicyError, Target, Workload};

/// One workload's periodic checkpoints: its part of the workload's slot (see `slots.rs`).
#[derive(Debug, Default)]
pub(super) struct PeriodicSlot {
    /// When the last one started; kept while they are due.
    last: Option<Instant>,
    /// One is under way.
    running: bool,
    /// Its interval, when shortened to fit the notice window (see `evacuate`).
    pub(super) fitted: Option<Duration>,
}

impl PeriodicSlot {
    pub(super) fn is_empty(&self) -> bool {
        self.last.is_none() && !self.running && self.fitted.is_none()
    }
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
        self.workloads.with(name, |slot| slot.periodic.last = Some(Instant::now()));
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
                self.workloads.with(&w.name, |slot| {
                    slot.periodic.last = None;
                    slot.periodic.fitted = None;
                });
                continue;
            };
            let every = self.fitted_interval(w, Duration::from_millis(every_ms), spot);
            let start = self.workloads.with(&w.name, |slot| {
                let schedule = &mut slot.periodic;
                let started = *schedule.last.get_or_insert(now);
                if now.duration_since(started) < every || std::mem::replace(&mut schedule.running, true) {
                    return false;
                }
                schedule.last = Some(now);
                true
            });
            if !start {
                continue;
            }
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
                engine.workloads.with(&name, |slot| slot.periodic.running = false);
            });
        }
    }
}
