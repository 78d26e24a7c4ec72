//! Chains of tracked checkpoints against the fake CRIU, which sends its one page as unchanged
//! when the page server says it has the previous checkpoint, and the real file store.

use std::sync::Arc;

use crate::criu::fake::FakeCriu;
use crate::cuda::fake::FakeGpu;
use crate::engine::inspect::TreeInfo;
use crate::engine::rollback_tests::{CHILD, Extras, ROOT, Rig, quiet, rig, rig_with};
use crate::engine::{Caller, CheckpointOutcome, CheckpointParams, Target};

fn tracking_rig() -> Rig {
    let extras = Extras { memory_tracking: true, ..Default::default() };
    rig_with(FakeCriu::default(), FakeGpu::default(), extras)
}

/// The memory checkpoint `id` restores: its page files, in name order, one after the other.
async fn restored_pages(r: &Rig, id: &str) -> Vec<u8> {
    let store = &r.engine.deps.store;
    let manifest = store.manifest(id).await.unwrap();
    let dir = tempfile::tempdir().unwrap();
    store.materialize(&manifest, dir.path(), Arc::new(|_, _| {})).await.unwrap();
    let mut pages: Vec<_> = std::fs::read_dir(dir.path())
        .unwrap()
        .map(|e| e.unwrap().path())
        .filter(|p| p.file_name().unwrap().to_string_lossy().starts_with("pages-"))
        .collect();
    pages.sort();
    pages.iter().flat_map(|p| std::fs::read(p).unwrap()).collect()
}

async fn left_running(r: &Rig) -> CheckpointOutcome {
    r.checkpoint(true).await.unwrap()
}

#[tokio::test]
async fn a_later_checkpoint_takes_the_unchanged_pages_from_the_one_before() {
    let r = tracking_rig();
    let first = left_running(&r).await;
    assert_eq!(first.stats.bytes_unchanged, 0, "the first reads everything");
    let second = left_running(&r).await;
    assert_eq!(second.stats.bytes_unchanged, 4096, "the page came as unchanged");
    assert_eq!(second.stats.chunks_total, first.stats.chunks_total);
    // The eviction too, streamed while CRIU sends.
    let evicted = r.checkpoint(false).await.unwrap();
    assert_eq!(evicted.stats.bytes_unchanged, 4096);
    for id in [&first.id, &second.id, &evicted.id] {
        assert_eq!(restored_pages(&r, id).await, vec![0x5a; 4096], "checkpoint {id} restores whole");
    }
}

#[tokio::test]
async fn without_soft_dirty_every_checkpoint_reads_everything() {
    let r = rig(FakeCriu::default(), FakeGpu::default());
    left_running(&r).await;
    assert_eq!(left_running(&r).await.stats.bytes_unchanged, 0);
}

#[tokio::test]
async fn a_failed_checkpoint_another_tree_or_another_workloads_dump_breaks_the_chain() {
    let r = tracking_rig();
    left_running(&r).await;
    // A checkpoint that fails after its dump (its commit): its bits may be cleared.
    r.break_commits();
    r.checkpoint(true).await.unwrap_err();
    r.mend_commits();
    assert_eq!(left_running(&r).await.stats.bytes_unchanged, 0, "after a failed one");
    assert_eq!(left_running(&r).await.stats.bytes_unchanged, 4096, "the chain goes on");

    // A dump of another workload that holds one of the tree's processes.
    let child = TreeInfo {
        pids: vec![CHILD],
        started: [(CHILD, 1)].into(),
        ..r.host.trees.lock().unwrap()[&ROOT].clone()
    };
    r.host.trees.lock().unwrap().insert(CHILD, child);
    let params = CheckpointParams {
        target: Target::Pid(CHILD),
        leave_running: true,
        answer_early: None,
        reclaim: None,
        caller: Caller::Root,
    };
    r.engine.checkpoint(params, quiet()).await.unwrap();
    assert_eq!(left_running(&r).await.stats.bytes_unchanged, 0, "after another workload's dump");

    // Another tree at the same pid (a restore, a pid reused).
    left_running(&r).await;
    r.host.trees.lock().unwrap().get_mut(&ROOT).unwrap().started.insert(ROOT, 2);
    assert_eq!(left_running(&r).await.stats.bytes_unchanged, 0, "another tree");
}

#[test]
fn status_says_tracking_goes_by_huge_pages_under_always() {
    use super::tracking_report;
    let on = tracking_report(&Ok(()), Some("always"));
    assert!(
        on.starts_with("on (soft-dirty, by 2 MiB") && on.contains("'madvise' tracks 4 KiB pages"),
        "{on}"
    );
    for mode in [Some("madvise"), Some("never"), None] {
        assert_eq!(
            tracking_report(&Ok(()), mode),
            "on (soft-dirty): a later checkpoint reads only the pages written since"
        );
    }
    let off = tracking_report(&Err("no soft-dirty".into()), Some("always"));
    assert_eq!(off, "off (no soft-dirty): every checkpoint reads all memory");
}
