//! Evacuation: making every opted-in (`spot`) workload durable before the machine goes, on a
//! cloud's preemption notice (`crate::notice`) or on request (`stasis evacuate`).
//!
//! ```text
//!  notice (deadline T) ─> candidates: spot workloads running here
//!                      ─> plan: estimate each from its last checkpoint, shortest first
//!                      ─> PARALLEL workers take them in order: eviction checkpoint each
//!                      ─> each workload's record: durable when (before T?), or why not
//! ```
//!
//! A reclaimed workload is durable already (its checkpoint is in the store). Periodic
//! checkpoints pause during an evacuation: they would only delay the evictions. A rebalance
//! recommendation runs the same plan with checkpoints left running, so that the eviction a
//! later notice brings has little left to store.

pub mod plan;

use std::collections::VecDeque;
use std::sync::{Arc, Mutex};
use std::time::{Duration, SystemTime, UNIX_EPOCH};

use serde::{Deserialize, Serialize};
use tracing::{info, warn};

use super::{Caller, CheckpointParams, Engine, PolicyError, Target, Workload, lock, now_unix_ms};
use plan::Candidate;

/// Workloads checkpointed at once: two keep the pipeline busy while one is frozen in CRIU
/// and the other uploads, without splitting the bandwidth so finely that none finishes.
const PARALLEL: usize = 2;

/// Why, and by when.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct EvacuateParams {
    /// What asked for it (the cloud's notice, or a user), for the records.
    pub cause: String,
    /// When the machine goes.
    pub deadline: SystemTime,
    /// Checkpoint and leave running (a rebalance recommendation) instead of evicting.
    pub leave_running: bool,
}

/// What an evacuation did with one workload; kept in its record (`stasis status`).
#[derive(Debug, Clone, Default, PartialEq, Eq, Serialize, Deserialize)]
pub struct Evacuation {
    pub workload: String,
    pub cause: String,
    pub notice_unix_ms: u64,
    pub deadline_unix_ms: u64,
    /// The planner's estimate of its checkpoint.
    pub estimate_ms: u64,
    /// The checkpoint that holds it, once durable.
    pub checkpoint: Option<String>,
    pub durable_unix_ms: Option<u64>,
    /// Why it is not durable.
    pub error: Option<String>,
}

impl Evacuation {
    /// Durable before the deadline.
    pub fn in_time(&self) -> bool {
        self.durable_unix_ms.is_some_and(|t| t <= self.deadline_unix_ms)
    }
}

impl Engine {
    /// Opts `name` in to (or out of) evacuation on a preemption notice.
    pub fn set_spot(&self, name: &str, on: bool, caller: Caller) -> Result<(), PolicyError> {
        self.own_workload(name, caller)?;
        self.registry.update(name, |w| w.spot = on).map_err(PolicyError::Registry)?;
        info!(workload = name, spot = on, "evacuation on preemption notices set");
        Ok(())
    }

    /// Makes every opted-in workload durable, the most possible before `params.deadline`;
    /// answers what became of each, in the order they were taken.
    pub async fn evacuate(self: &Arc<Self>, params: EvacuateParams) -> Vec<Evacuation> {
        let notice_unix_ms = now_unix_ms();
        let deadline_unix_ms = params.deadline.duration_since(UNIX_EPOCH).map_or(0, |d| d.as_millis() as u64);
        let base = Evacuation {
            cause: params.cause.clone(),
            notice_unix_ms,
            deadline_unix_ms,
            ..Default::default()
        };
        let (mut done, candidates) = self.survey(&base, !params.leave_running);
        let planned = plan::order(candidates, notice_unix_ms);
        let left_ms = deadline_unix_ms.saturating_sub(notice_unix_ms);
        let order: Vec<(&str, u64)> =
            planned.iter().map(|(c, e)| (c.name.as_str(), e.as_millis() as u64)).collect();
        info!(cause = %params.cause, left_ms, leave_running = params.leave_running, ?order, "evacuating");
        let queue = Arc::new(Mutex::new(VecDeque::from(planned)));
        let mut workers = tokio::task::JoinSet::new();
        for _ in 0..PARALLEL {
            let (engine, queue, base) = (self.clone(), queue.clone(), base.clone());
            let leave_running = params.leave_running;
            workers.spawn(async move {
                let mut results = Vec::new();
                loop {
                    let next = lock(&queue).pop_front();
                    let Some((candidate, estimate)) = next else { break };
                    let evicting =
                        engine.workloads.read(&candidate.name, |slot| slot.evacuation == Some(true));
                    if leave_running && evicting == Some(true) {
                        // A preemption took it over meanwhile: its eviction comes instead.
                        continue;
                    }
                    let result = engine.evacuate_one(&candidate.name, leave_running).await;
                    let (checkpoint, error) = match result {
                        Ok(id) => (Some(id), None),
                        Err(why) => (None, Some(why)),
                    };
                    let durable_unix_ms = checkpoint.is_some().then(now_unix_ms);
                    engine.release(&candidate.name, !leave_running);
                    let (workload, estimate_ms) = (candidate.name, estimate.as_millis() as u64);
                    results.push(Evacuation {
                        workload,
                        estimate_ms,
                        checkpoint,
                        durable_unix_ms,
                        error,
                        ..base.clone()
                    });
                }
                results
            });
        }
        while let Some(joined) = workers.join_next().await {
            done.extend(joined.unwrap_or_default());
        }
        self.record_evacuations(&done, params.leave_running);
        done
    }

    /// The spot workloads: those reclaimed, durable already (as `base` records them), and
    /// those running here, claimed for this evacuation (see `claim`).
    fn survey(&self, base: &Evacuation, evict: bool) -> (Vec<Evacuation>, Vec<Candidate>) {
        let (mut durable, mut candidates) = (Vec::new(), Vec::new());
        for w in self.registry.all().into_iter().filter(|w| w.spot) {
            if let Some(reclaimed) = &w.reclaimed {
                let checkpoint = Some(reclaimed.checkpoint.clone());
                let durable_unix_ms = Some(base.notice_unix_ms);
                durable.push(Evacuation { workload: w.name, checkpoint, durable_unix_ms, ..base.clone() });
            } else if self.deps.host.is_running(w.pid) && self.claim(&w.name, evict) {
                candidates.push(self.candidate(&w));
            }
        }
        (durable, candidates)
    }

    /// Workload `w` as the planner sees it: its tree's memory now and its last checkpoint.
    fn candidate(&self, w: &Workload) -> Candidate {
        let resident = self.deps.host.resident_bytes(&self.deps.host.trees(&[w.pid]));
        Candidate { name: w.name.clone(), resident, last: w.last_cost }
    }

    /// Checkpoints `name` (evicting it unless `leave_running`); answers the checkpoint's id.
    async fn evacuate_one(self: &Arc<Self>, name: &str, leave_running: bool) -> Result<String, String> {
        let params = CheckpointParams {
            target: Target::Workload(name.to_owned()),
            leave_running,
            answer_early: None,
            reclaim: None,
            caller: Caller::Root,
        };
        match self.checkpoint(params, Arc::new(|_| {})).await {
            Ok(outcome) => Ok(outcome.id),
            Err(e) => Err(crate::error_chain(&e)),
        }
    }

    /// Logs each result and keeps an eviction's in its workload's record.
    fn record_evacuations(&self, results: &[Evacuation], leave_running: bool) {
        for e in results {
            let late_ms = e.durable_unix_ms.map(|t| t as i64 - e.deadline_unix_ms as i64);
            match &e.error {
                None => {
                    info!(workload = %e.workload, checkpoint = ?e.checkpoint, estimate_ms = e.estimate_ms, after_ms = e.durable_unix_ms.map(|t| t.saturating_sub(e.notice_unix_ms)), in_time = e.in_time(), ?late_ms, "evacuated")
                }
                Some(error) => {
                    warn!(workload = %e.workload, %error, "evacuation failed: the workload is not durable")
                }
            }
            if leave_running {
                continue;
            }
            if let Err(err) = self.registry.update(&e.workload, |w| w.evacuation = Some(e.clone())) {
                warn!(workload = %e.workload, error = %err, "cannot record the evacuation in the registry");
            }
        }
    }

    /// The periodic interval of `w` (set to `every`): shortened, when the notice window is
    /// known and `w` is a spot workload, so that an eviction at any moment stores its delta
    /// within its share of the window (half of it, split among the rounds `spot` workloads
    /// take `PARALLEL` at a time).
    pub(super) fn fitted_interval(&self, w: &Workload, every: Duration, spot: usize) -> Duration {
        let Some(window) = self.settings.notice_window.filter(|_| w.spot && w.last_cost.is_some()) else {
            return every;
        };
        let rounds = spot.div_ceil(PARALLEL).max(1) as u32;
        let fitted = plan::fitting_interval(&self.candidate(w), every, window / 2 / rounds);
        let shown = (fitted != every).then_some(fitted);
        let before = self.workloads.with(&w.name, |slot| std::mem::replace(&mut slot.periodic.fitted, shown));
        if shown.is_some() && before != shown {
            info!(workload = %w.name, every_ms = every.as_millis() as u64, fitted_ms = fitted.as_millis() as u64, window_ms = window.as_millis() as u64, "periodic interval shortened to fit the notice window");
        }
        fitted
    }

    /// Claims `name` for an evacuation's checkpoint (an eviction if `evict`). Another
    /// evacuation's claim stands, except that an eviction also queues behind a checkpoint left
    /// running (a rebalance's): the machine goes all the same, and the delta is smaller then.
    fn claim(&self, name: &str, evict: bool) -> bool {
        self.workloads.with(name, |slot| match slot.evacuation {
            Some(evicting) if evicting || !evict => false,
            _ => {
                slot.evacuation = Some(evict);
                true
            }
        })
    }

    /// Ends the claim on `name` (an eviction's claim outlives a rebalance's it replaced).
    fn release(&self, name: &str, evict: bool) {
        self.workloads.with(name, |slot| {
            if slot.evacuation == Some(evict) {
                slot.evacuation = None;
            }
        });
    }

    /// Whether an evacuation is under way (periodic checkpoints wait meanwhile).
    pub(super) fn is_evacuating(&self) -> bool {
        self.workloads.any(|slot| slot.evacuation.is_some())
    }
}

#[cfg(test)]
mod tests;
