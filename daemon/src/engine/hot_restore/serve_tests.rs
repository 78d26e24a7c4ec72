//! A lazy restore's memory served through the fake's userfaultfds (engine/host/fake_faults.rs):
//! the fake CRIU hands the restored pid's userfaultfd over on the lazy-pages socket, as CRIU
//! does, and the fault server answers the faults the fake reports (rollback_tests' rig, whose
//! dump holds one page of 0x5a bytes at 0x10000).

use nix::errno::Errno;
use nix::sys::signal::Signal;
use tempfile::TempDir;

use super::{FaultServerError, LazyError};
use crate::criu::fake::FakeCriu;
use crate::cuda::fake::FakeGpu;
use crate::engine::Caller;
use crate::engine::rollback_tests::{CHILD, ROOT, Rig, quiet, rig};
use crate::engine::{RestoreError, RestoreOutcome, RestoreParams, RestoreTarget};

/// Where the rig's dump has its page.
const PAGE_AT: u64 = 0x10000;

/// An evicted tree whose page a lazy restore leaves in the store, on a host whose lazy-restore
/// guard is a stand-in in the directory returned.
async fn evicted() -> (Rig, String, TempDir) {
    let r = rig(FakeCriu { lazy: true, ..Default::default() }, FakeGpu::default());
    let helpers = tempfile::tempdir().unwrap();
    r.host.install_guard(helpers.path());
    let id = r.checkpoint(false).await.unwrap().id;
    r.host.signals.lock().unwrap().clear();
    (r, id, helpers)
}

/// Restores `id` with its memory served: lazily (the tree runs before its memory is in) or
/// eagerly (held until it is).
async fn restore(r: &Rig, id: &str, lazy: bool) -> Result<RestoreOutcome, RestoreError> {
    let params = RestoreParams {
        target: RestoreTarget::Checkpoint(id.into()),
        gpu_map: Vec::new(),
        lazy,
        tcp_close: false,
        on_running: None,
        caller: Caller::Root,
        as_workload: None,
        into: None,
    };
    r.engine.restore(params, quiet()).await
}

#[tokio::test]
async fn a_lazy_restore_whose_copy_fails_kills_the_tree_and_fails() {
    let (r, id, _helpers) = evicted().await;
    *r.host.faults.at.lock().unwrap() = vec![PAGE_AT + 8];
    *r.host.faults.copy_fails.lock().unwrap() = Some(Errno::EFAULT);
    let err = restore(&r, &id, true).await.unwrap_err();
    // The copy fails once the tree runs, or (the page arriving in the background) before CRIU
    // let it run: either way that is the reason given.
    let (RestoreError::Lazy { source: LazyError::Serve(e), pid: ROOT, .. }
    | RestoreError::LazyDuringRestore { source: LazyError::Serve(e), .. }) = &err
    else {
        panic!("{err:?}")
    };
    assert!(
        matches!(**e, FaultServerError::Fill { pid: ROOT, address: PAGE_AT, errno: Errno::EFAULT }),
        "{e:?}"
    );
    // The tree ran with a page it will never get: it is killed, nothing of it runs on.
    let killed = r.host.signals_of(Signal::SIGKILL);
    assert!(killed.contains(&ROOT) && killed.contains(&CHILD), "{killed:?}");
    assert!(r.host.running.lock().unwrap().is_empty(), "nothing left running");
    assert!(r.host.faults.placed.lock().unwrap().is_empty(), "nothing was put in place");
}

#[tokio::test]
async fn a_fault_where_no_image_has_memory_reads_zeros_and_the_rest_comes_in() {
    let (r, id, _helpers) = evicted().await;
    // Memory the tree mapped since its checkpoint (a heap grown, say): no image holds it.
    let elsewhere = 0x7f00_0000;
    *r.host.faults.at.lock().unwrap() = vec![elsewhere + 0x123];
    let outcome = restore(&r, &id, true).await.unwrap();
    assert_eq!(outcome.pid, ROOT);
    let placed = r.host.faults.placed.lock().unwrap().clone();
    assert!(placed.contains(&(elsewhere, None)), "a zero page where the fault was: {placed:?}");
    assert!(placed.contains(&(PAGE_AT, Some(vec![0x5a; 4096]))), "the page the image holds, in place");
    assert!(r.host.signals_of(Signal::SIGKILL).is_empty(), "nothing killed");
    assert!(r.host.running.lock().unwrap().contains(&ROOT), "the tree runs on");
}

#[tokio::test]
async fn an_eager_restore_puts_each_page_in_place_once_before_the_tree_runs() {
    let (r, id, _helpers) = evicted().await;
    let outcome = restore(&r, &id, false).await.unwrap();
    assert_eq!(outcome.pid, ROOT);
    // Put in place by the thread that decoded it, or by the server: once either way.
    let placed = r.host.faults.placed.lock().unwrap().clone();
    assert_eq!(placed, [(PAGE_AT, Some(vec![0x5a; 4096]))]);
    assert!(r.host.signals_of(Signal::SIGKILL).is_empty(), "nothing killed");
    assert!(r.host.running.lock().unwrap().contains(&ROOT), "the tree runs on");
}

#[tokio::test]
async fn an_eager_restore_whose_copies_fail_kills_the_tree_before_it_runs() {
    let (r, id, _helpers) = evicted().await;
    // Refused to the decoding thread as to the server.
    *r.host.faults.copy_fails.lock().unwrap() = Some(Errno::EFAULT);
    let err = restore(&r, &id, false).await.unwrap_err();
    let RestoreError::LazyDuringRestore { source: LazyError::Serve(e), .. } = &err else { panic!("{err:?}") };
    assert!(
        matches!(**e, FaultServerError::Fill { pid: ROOT, address: PAGE_AT, errno: Errno::EFAULT }),
        "{e:?}"
    );
    assert!(r.host.running.lock().unwrap().is_empty(), "nothing left running");
    assert!(r.host.faults.placed.lock().unwrap().is_empty(), "nothing was put in place");
}
