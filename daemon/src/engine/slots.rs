//! What stasisd keeps in memory for each workload beside its record in the registry
//! (`workloads.rs`): one slot per workload name, holding its job lock, where it stands with
//! idle reclaim (`idle/`), its periodic schedule (`periodic.rs`) and an evacuation's claim on
//! it (`evacuate/`).
//!
//! A slot exists only while it holds something: every change goes through [`Slots::with`],
//! which removes a slot the change leaves empty, and a job's turn tidies its slot when it
//! ends. A workload nothing is under way for (no job, no policy watched, no claim) leaves no
//! entry behind.

use std::collections::HashMap;
use std::sync::{Arc, Mutex};

use tokio::sync::OwnedMutexGuard;

use super::idle::IdleSlot;
use super::lock;
use super::periodic::PeriodicSlot;

/// What is under way for one workload.
#[derive(Default)]
pub(super) struct Slot {
    /// One job at a time per workload.
    job: Arc<tokio::sync::Mutex<()>>,
    pub(super) idle: IdleSlot,
    pub(super) periodic: PeriodicSlot,
    /// Claimed by an evacuation; `Some(true)` when it evicts the workload (see `evacuate`).
    pub(super) evacuation: Option<bool>,
}

impl Slot {
    /// Holds nothing: no job holds or waits for its lock, nothing else is kept.
    fn is_empty(&self) -> bool {
        Arc::strong_count(&self.job) == 1
            && self.idle.is_empty()
            && self.periodic.is_empty()
            && self.evacuation.is_none()
    }
}

/// The slots of all workloads, by name.
#[derive(Default)]
pub(super) struct Slots {
    table: Mutex<HashMap<String, Slot>>,
}

impl Slots {
    /// Runs `change` on the slot of `name` (made if there is none); removes the slot if that
    /// leaves it empty.
    pub(super) fn with<T>(&self, name: &str, change: impl FnOnce(&mut Slot) -> T) -> T {
        let mut table = lock(&self.table);
        let slot = table.entry(name.to_owned()).or_default();
        let out = change(slot);
        if slot.is_empty() {
            table.remove(name);
        }
        out
    }

    /// What `read` finds in the slot of `name`; `None` when it has none.
    pub(super) fn read<T>(&self, name: &str, read: impl FnOnce(&Slot) -> T) -> Option<T> {
        lock(&self.table).get(name).map(read)
    }

    /// Whether the slot of any workload is as `test` wants it.
    pub(super) fn any(&self, test: impl Fn(&Slot) -> bool) -> bool {
        lock(&self.table).values().any(test)
    }

    /// Waits for the turn of `name` to run a job; the turn lasts until it is dropped.
    pub(super) async fn job_turn(&self, name: &str) -> JobTurn<'_> {
        let job = self.with(name, |slot| slot.job.clone());
        // Made before waiting, so that a wait given up also tidies the slot.
        let mut turn = JobTurn { slots: self, name: name.to_owned(), job: Some(job.clone()), held: None };
        turn.held = Some(job.lock_owned().await);
        turn
    }

    /// The names that have a slot.
    #[cfg(test)]
    pub(super) fn names(&self) -> Vec<String> {
        lock(&self.table).keys().cloned().collect()
    }
}

/// A workload's turn to run a job (see [`Slots::job_turn`]).
pub(super) struct JobTurn<'a> {
    slots: &'a Slots,
    name: String,
    job: Option<Arc<tokio::sync::Mutex<()>>>,
    held: Option<OwnedMutexGuard<()>>,
}

impl Drop for JobTurn<'_> {
    fn drop(&mut self) {
        self.held = None;
        self.job = None;
        self.slots.with(&self.name, |_| ());
    }
}

#[cfg(test)]
mod tests {
    use std::time::{Duration, SystemTime};

    use super::*;
    use crate::criu::fake::FakeCriu;
    use crate::cuda::fake::FakeGpu;
    use crate::engine::rollback_tests::rig;
    use crate::engine::{Caller, EvacuateParams};

    #[tokio::test]
    async fn a_workload_nothing_is_under_way_for_leaves_no_slot() {
        let r = rig(FakeCriu::default(), FakeGpu::default());
        let name = r.checkpoint(true).await.unwrap().workload;
        assert!(r.engine.workloads.names().is_empty(), "a job's lock goes with the job");
        let engine = &r.engine;
        engine.set_idle(&name, Some(Duration::from_secs(3600)), Caller::Root).unwrap();
        engine.set_periodic(&name, Some(Duration::from_secs(3600)), Caller::Root).unwrap();
        engine.set_spot(&name, true, Caller::Root).unwrap();
        let notice = EvacuateParams {
            cause: "test: rebalance".into(),
            deadline: SystemTime::now() + Duration::from_secs(30),
            leave_running: true,
        };
        engine.evacuate(notice).await;
        let tick = || {
            let workloads = engine.registry.all();
            engine.idle_tick(&workloads);
            engine.periodic_tick(&workloads);
        };
        tick();
        assert_eq!(engine.workloads.names(), [name.as_str()], "watched and scheduled");

        engine.set_idle(&name, None, Caller::Root).unwrap();
        engine.set_periodic(&name, None, Caller::Root).unwrap();
        engine.set_spot(&name, false, Caller::Root).unwrap();
        tick();
        assert!(engine.workloads.names().is_empty(), "{:?}", engine.workloads.names());
        r.break_commits();
        assert!(r.checkpoint(true).await.is_err());
        assert!(engine.workloads.names().is_empty(), "a failed job's lock goes with it too");
    }

    #[tokio::test]
    async fn a_slot_goes_with_the_last_job_that_waited_for_it() {
        let slots = Slots::default();
        let first = slots.job_turn("w").await;
        let second = slots.job_turn("w");
        tokio::pin!(second);
        assert!(futures::poll!(second.as_mut()).is_pending(), "one job at a time");
        drop(first);
        assert_eq!(slots.names(), ["w"], "the waiting job keeps the slot");
        drop(second.await);
        assert!(slots.names().is_empty());
    }

    #[tokio::test]
    async fn a_wait_given_up_leaves_no_slot() {
        let slots = Slots::default();
        let held = slots.job_turn("w").await;
        let given_up = tokio::time::timeout(std::time::Duration::from_millis(10), slots.job_turn("w")).await;
        assert!(given_up.is_err());
        drop(held);
        assert!(slots.names().is_empty());
    }

    #[test]
    fn a_change_that_empties_a_slot_removes_it() {
        let slots = Slots::default();
        slots.with("w", |slot| slot.evacuation = Some(true));
        assert!(slots.any(|slot| slot.evacuation == Some(true)));
        slots.with("w", |slot| slot.evacuation = None);
        assert!(slots.names().is_empty());
        assert_eq!(slots.read("w", |slot| slot.evacuation), None);
    }
}
