//! Evacuations and node checks on the fakes of `rollback_tests`: what each leaves behind.

use std::time::{Duration, SystemTime};

use nix::sys::signal::Signal;

use super::EvacuateParams;
use crate::criu::fake::FakeCriu;
use crate::cuda::fake::FakeGpu;
use crate::engine::rollback_tests::{CHILD, ROOT, Rig, rig};
use crate::engine::{Caller, RestoreError};

fn params(leave_running: bool) -> EvacuateParams {
    EvacuateParams {
        cause: "test: notice".into(),
        deadline: SystemTime::now() + Duration::from_secs(30),
        leave_running,
    }
}

/// A rig whose tree is a registered workload (one checkpoint left running), opted in.
async fn spot_rig() -> (Rig, String) {
    let r = rig(FakeCriu::default(), FakeGpu::default());
    let name = r.checkpoint(true).await.unwrap().workload;
    r.engine.set_spot(&name, true, Caller::Root).unwrap();
    (r, name)
}

#[tokio::test]
async fn an_evacuation_evicts_each_spot_workload_and_records_it() {
    let (r, name) = spot_rig().await;
    let done = r.engine.evacuate(params(false)).await;
    assert_eq!(done.len(), 1);
    let e = &done[0];
    assert_eq!((e.workload.as_str(), e.error.as_deref()), (name.as_str(), None));
    assert!(e.in_time() && e.checkpoint.is_some(), "{e:?}");
    assert!(e.estimate_ms > 0, "planned from the last checkpoint: {e:?}");
    assert_eq!(r.host.signals_of(Signal::SIGKILL), [ROOT, CHILD], "evicted");
    assert_eq!(r.checkpoints().await, 2);
    let recorded = r.engine.registry.get(&name).unwrap().evacuation.unwrap();
    assert_eq!(&recorded, e);
    // Nothing runs any more: a second notice finds nothing to do.
    assert!(r.engine.evacuate(params(false)).await.is_empty());
}

#[tokio::test]
async fn a_failed_eviction_says_why_and_leaves_the_workload_running() {
    let (r, name) = spot_rig().await;
    r.break_commits();
    let done = r.engine.evacuate(params(false)).await;
    let e = &done[0];
    assert!(e.checkpoint.is_none() && e.durable_unix_ms.is_none() && !e.in_time(), "{e:?}");
    assert!(e.error.as_deref().unwrap().contains("storing checkpoint"), "{e:?}");
    assert!(r.host.signals_of(Signal::SIGKILL).is_empty(), "a tree not stored must not be killed");
    assert!(r.engine.registry.get(&name).unwrap().evacuation.is_some_and(|r| r.error.is_some()));
    assert!(!r.engine.is_evacuating(), "its claim is released");
}

#[tokio::test]
async fn a_rebalance_checkpoints_without_stopping_and_leaves_no_record() {
    let (r, name) = spot_rig().await;
    let done = r.engine.evacuate(params(true)).await;
    assert!(done[0].checkpoint.is_some(), "{done:?}");
    assert!(r.host.signals.lock().unwrap().is_empty(), "left running: neither stopped nor killed");
    assert!(r.engine.registry.get(&name).unwrap().evacuation.is_none());
}

#[tokio::test]
async fn workloads_not_opted_in_are_left_alone() {
    let r = rig(FakeCriu::default(), FakeGpu::default());
    let name = r.checkpoint(true).await.unwrap().workload;
    r.engine.set_spot(&name, true, Caller::Root).unwrap();
    r.engine.set_spot(&name, false, Caller::Root).unwrap();
    assert!(r.engine.evacuate(params(false)).await.is_empty());
    assert!(r.host.signals.lock().unwrap().is_empty());
}

#[tokio::test]
async fn a_spot_workloads_periodic_interval_fits_the_notice_window() {
    let (r, name) = spot_rig().await;
    let w = r.engine.registry.get(&name).unwrap();
    // The fake tree's checkpoint is tiny and quick: ten minutes of its dirtying fit 30 s.
    let every = Duration::from_secs(600);
    assert_eq!(r.engine.fitted_interval(&w, every, 1), every);
    // Not a spot workload: never adapted.
    let plain = crate::engine::Workload { spot: false, ..w };
    assert_eq!(r.engine.fitted_interval(&plain, every, 1), every);
}

#[tokio::test]
async fn a_node_whose_cpu_lacks_an_extension_refuses_the_restore_untouched() {
    let r = rig(FakeCriu::default(), FakeGpu::default());
    r.host.cpu_flags.lock().unwrap().extend(["avx2".to_string(), "avx512f".to_string()]);
    let ck = r.checkpoint(false).await.unwrap();
    r.host.cpu_flags.lock().unwrap().remove("avx512f");
    r.host.signals.lock().unwrap().clear();
    let err = r.restore(&ck.id).await.unwrap_err();
    assert!(matches!(err, RestoreError::Incompatible { .. }), "{err}");
    assert!(err.to_string().contains("lacks avx512f"), "{err}");
    assert!(!r.criu.calls().iter().any(|c| c.starts_with("restore")), "CRIU was asked to restore");
    assert!(r.host.signals.lock().unwrap().is_empty());
}
