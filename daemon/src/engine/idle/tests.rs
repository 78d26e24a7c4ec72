//! The idle monitor on the fakes of `rollback_tests` and a fake [`GpuActivity`]: which
//! workloads a tick finds busy, and the reclaim of one found idle.

use std::sync::Arc;
use std::time::Duration;

use nix::sys::signal::Signal;

use super::activity::FakeGpuActivity;
use super::{GpuActivity, IdleState};
use crate::criu::fake::FakeCriu;
use crate::cuda::fake::FakeGpu;
use crate::engine::host::{Host, Usage};
use crate::engine::rollback_tests::{CHILD, Extras, ROOT, Rig, rig, rig_with};
use crate::engine::sockets::record;
use crate::engine::{Caller, PolicyError, RestoreOutcome, Workload};
use crate::linux::net::WaitingInput;
use stasis_criu_images::testing::catch_running;

/// How long a watched workload must be idle to be reclaimed, in these tests.
const IDLE_AFTER: Duration = Duration::from_millis(50);

/// A rig whose tree is a registered workload (one checkpoint left running) with an idle
/// policy, on GPU activity `gpu`; returns the workload's name.
async fn watched_rig(gpu: &Arc<FakeGpuActivity>) -> (Rig, String) {
    let activity: Arc<dyn GpuActivity> = gpu.clone();
    let extras = Extras { gpu_activity: Some(activity), ..Default::default() };
    let r = rig_with(FakeCriu::default(), FakeGpu::default(), extras);
    let name = r.checkpoint(true).await.unwrap().workload;
    r.engine.set_idle(&name, Some(IDLE_AFTER), Caller::Root).unwrap();
    (r, name)
}

impl Rig {
    fn workload(&self, name: &str) -> Workload {
        self.engine.registry.get(name).unwrap()
    }

    /// One tick of the idle monitor, after `after`; returns where `name` stands then.
    async fn tick(&self, name: &str, after: Duration) -> IdleState {
        tokio::time::sleep(after).await;
        self.engine.idle_tick(&self.engine.registry.all());
        self.engine.idle_state(&self.workload(name))
    }
}

#[tokio::test]
async fn a_workload_busy_only_on_the_gpu_is_kept_and_reclaimed_once_it_stops() {
    let gpu = Arc::new(FakeGpuActivity::default());
    let (r, name) = watched_rig(&gpu).await;
    // The first tick only takes a sample to compare the next ones with.
    assert!(matches!(r.tick(&name, Duration::ZERO).await, IdleState::Watched(_)));
    // No CPU time, nothing read: only NVML sees the root use a GPU.
    gpu.active.lock().unwrap().insert(ROOT as u32);
    let state = r.tick(&name, IDLE_AFTER * 2).await;
    assert!(matches!(state, IdleState::Watched(idle) if idle < IDLE_AFTER), "{state:?}");
    assert!(r.host.signals_of(Signal::SIGKILL).is_empty());
    assert_eq!(r.checkpoints().await, 1, "no reclaim");

    gpu.active.lock().unwrap().clear();
    let state = r.tick(&name, IDLE_AFTER * 2).await;
    assert!(matches!(state, IdleState::Reclaiming | IdleState::Reclaimed), "{state:?}");
    let reclaimed = tokio::time::timeout(Duration::from_secs(10), async {
        loop {
            if let Some(reclaimed) = r.workload(&name).reclaimed {
                return reclaimed;
            }
            tokio::time::sleep(Duration::from_millis(10)).await;
        }
    })
    .await
    .expect("the reclaim should finish");
    assert_eq!(r.engine.idle_state(&r.workload(&name)), IdleState::Reclaimed);
    assert_eq!(r.host.signals_of(Signal::SIGKILL), [ROOT, CHILD], "the reclaim evicted the tree");
    assert_eq!(r.checkpoints().await, 2);
    assert!(reclaimed.listeners.is_empty() && reclaimed.ports.is_empty(), "the tree held no sockets");
    // Each question asked for what happened since the one before.
    let asked = gpu.asked.lock().unwrap().clone();
    assert_eq!(asked.len(), 3, "{asked:?}");
    assert!(asked.windows(2).all(|w| w[0] <= w[1]), "{asked:?}");
}

#[tokio::test]
async fn without_gpu_activity_a_workload_is_judged_by_its_cpu_time() {
    let gpu = Arc::new(FakeGpuActivity::default());
    *gpu.failure.lock().unwrap() = Some("NVML: driver gone".into());
    let (r, name) = watched_rig(&gpu).await;
    r.tick(&name, Duration::ZERO).await;
    for cpu_s in 1..=2 {
        // A full core's second of CPU time between ticks: busy, whatever NVML says.
        r.host.usage.lock().unwrap().insert(CHILD, Usage { cpu_ns: cpu_s * 1_000_000_000, read_bytes: 0 });
        let state = r.tick(&name, IDLE_AFTER * 2).await;
        assert!(matches!(state, IdleState::Watched(idle) if idle < IDLE_AFTER), "{state:?}");
    }
    assert_eq!(r.checkpoints().await, 1, "no reclaim");
    assert_eq!(gpu.asked.lock().unwrap().len(), 3, "NVML is asked at every tick, failing or not");
}

/// A rig whose tree is registered workload `name`, listening on a free port of 127.0.0.1
/// (for the fakes: nothing listens there); returns the port.
async fn listening_rig(r: &Rig) -> (String, u16) {
    let name = r.checkpoint(true).await.unwrap().workload;
    let port = std::net::TcpListener::bind("127.0.0.1:0").unwrap().local_addr().unwrap().port();
    let listener = record("tcp", "listen", &format!("127.0.0.1:{port}"), "");
    r.host.sockets.lock().unwrap().records.push(listener);
    (name, port)
}

#[tokio::test]
async fn a_use_seen_during_the_reclaim_leaves_the_workload_running() {
    let r = rig(FakeCriu::default(), FakeGpu::default());
    let (name, port) = listening_rig(&r).await;
    *r.host.segment.lock().unwrap() = Some(port);
    assert_eq!(r.engine.reclaim(&name).await.unwrap(), None, "the reclaim backs off");
    assert!(r.host.signals_of(Signal::SIGKILL).is_empty());
    assert_eq!(r.workload(&name).reclaimed, None);
    assert_eq!(r.checkpoints().await, 1, "seen before the dump began: nothing was dumped");
}

#[tokio::test]
async fn a_use_seen_during_the_dump_gives_the_stored_tree_back() {
    // The dump takes 400 ms; the use comes 100 ms after the reclaim's looks before it.
    let criu = FakeCriu {
        on_dump: Some(Box::new(|_| std::thread::sleep(Duration::from_millis(400)))),
        ..Default::default()
    };
    let r = rig(criu, FakeGpu::default());
    let (name, port) = listening_rig(&r).await;
    *r.host.segment.lock().unwrap() = Some(port);
    *r.host.segment_after.lock().unwrap() = super::in_use::LEFT_UNREAD + Duration::from_millis(100);
    backs_off(&r, &name).await;
    assert_eq!(r.checkpoints().await, 2, "the checkpoint is kept");
    assert!(r.host.is_running(ROOT), "the tree runs on");
}

/// Input on `port` of 127.0.0.1: `queued` connections waiting on a listener, or bytes unread
/// on connection `inode` from a client outside the tree.
pub(super) fn input(port: u16, inode: u64, queued: u32, listener: bool) -> WaitingInput {
    let remote = (!listener).then(|| std::net::SocketAddr::from(([127, 0, 0, 1], 50_000)));
    WaitingInput { inode, local: std::net::SocketAddr::from(([127, 0, 0, 1], port)), remote, queued }
}

/// Reclaims `name`; asserts that it backs off: the tree is given back, not killed.
async fn backs_off(r: &Rig, name: &str) {
    assert_eq!(r.engine.reclaim(name).await.unwrap(), None, "the reclaim backs off");
    assert!(r.host.signals_of(Signal::SIGKILL).is_empty());
    assert_eq!(r.workload(name).reclaimed, None);
}

#[tokio::test]
async fn a_connection_waiting_to_be_accepted_when_the_tree_stopped_leaves_the_workload_running() {
    // A client connected before the reclaim watched the ports (no use is seen), and the tree
    // stopped before accepting it: stopping the tree for good would leave it unanswered.
    let r = rig(FakeCriu::default(), FakeGpu::default());
    let (name, port) = listening_rig(&r).await;
    // The reclaim's two looks before the dump, then the one at the stop.
    r.host.waiting_input.lock().unwrap().extend([vec![], vec![], vec![input(port, 7, 1, true)]]);
    backs_off(&r, &name).await;
    // An eviction that is not a reclaim stops the tree whatever waits.
    let evicted = r.checkpoint(false).await.unwrap();
    assert!(!evicted.left_running);
}

#[tokio::test]
async fn a_request_unread_when_the_tree_stopped_leaves_the_workload_running() {
    // A connection holds 40 bytes the program leaves unread; a client's request came on it
    // unseen (no watch fires here), and the tree stopped before reading it.
    let r = rig(FakeCriu::default(), FakeGpu::default());
    let (name, port) = listening_rig(&r).await;
    let looks = [40, 40, 120].map(|bytes| vec![input(port, 7, bytes, false)]);
    r.host.waiting_input.lock().unwrap().extend(looks);
    backs_off(&r, &name).await;
}

#[tokio::test]
async fn bytes_the_program_leaves_unread_do_not_keep_the_workload() {
    let r = rig(FakeCriu::default(), FakeGpu::default());
    let (name, port) = listening_rig(&r).await;
    // Unread at both looks before the dump and at the stop (the last answer stays).
    r.host.waiting_input.lock().unwrap().push(vec![input(port, 7, 40, false)]);
    r.engine.reclaim(&name).await.unwrap().expect("reclaimed");
    assert_eq!(r.host.signals_of(Signal::SIGKILL), [ROOT, CHILD]);
}

#[tokio::test]
async fn a_thread_at_work_when_the_tree_stopped_leaves_the_workload_running() {
    // A request read before the watch began, still being served when the dump stopped the
    // tree: its answer would wait for the next wake.
    let criu = FakeCriu {
        on_dump: Some(Box::new(|spec| catch_running(&spec.images_dir, spec.pid as u32))),
        ..Default::default()
    };
    let r = rig(criu, FakeGpu::default());
    let (name, _) = listening_rig(&r).await;
    backs_off(&r, &name).await;
}

#[tokio::test]
async fn a_reclaim_whose_watches_cannot_be_installed_goes_on_unwatched() {
    let r = rig(FakeCriu::default(), FakeGpu::default());
    let (name, port) = listening_rig(&r).await;
    // A segment would come, but no watch sees it.
    *r.host.segment.lock().unwrap() = Some(port);
    r.host.fail("watch_ports");
    let reclaimed = r.engine.reclaim(&name).await.unwrap().expect("reclaimed");
    assert_eq!(reclaimed.ports, [port]);
    assert_eq!(r.host.signals_of(Signal::SIGKILL), [ROOT, CHILD], "the reclaim evicted the tree");
    assert_eq!(r.workload(&name).reclaimed, Some(reclaimed));
}

/// Reclaims `name`, then wakes it as `stasis wake` does.
async fn reclaim_and_wake(r: &Rig, name: &str) -> Result<RestoreOutcome, PolicyError> {
    r.engine.reclaim(name).await.unwrap().expect("reclaimed");
    r.engine.wake(name, Caller::Root).await
}

#[tokio::test]
async fn new_connections_are_held_from_the_reclaim_until_the_waker_listens_and_during_the_wake() {
    let r = rig(FakeCriu::default(), FakeGpu::default());
    let (name, port) = listening_rig(&r).await;
    r.engine.reclaim(&name).await.unwrap().expect("reclaimed");
    // Held as the reclaim shows, let go once the waker listens.
    assert_eq!(r.host.holds.lock().unwrap()[0].0, [port], "held from the end of the tree");
    let listening = async {
        while r.host.holds.lock().unwrap()[0].1 {
            tokio::time::sleep(std::time::Duration::from_millis(5)).await;
        }
    };
    tokio::time::timeout(std::time::Duration::from_secs(10), listening).await.expect("the waker listens");
    assert_eq!(r.engine.wake(&name, Caller::Root).await.unwrap().pid, ROOT);
    // The wake's own hold, on the listener's port, no longer in place either.
    assert_eq!(*r.host.holds.lock().unwrap(), [(vec![port], false), (vec![port], false)]);
}

#[tokio::test]
async fn a_wake_whose_hold_on_new_connections_fails_wakes_the_workload_all_the_same() {
    let r = rig(FakeCriu::default(), FakeGpu::default());
    let (name, _) = listening_rig(&r).await;
    r.host.fail("hold_new_connections");
    assert_eq!(reclaim_and_wake(&r, &name).await.unwrap().pid, ROOT);
    assert!(r.host.holds.lock().unwrap().is_empty());
    assert!(r.host.is_running(ROOT));
    assert_eq!(r.workload(&name).reclaimed, None);
}

#[tokio::test]
async fn the_waker_listens_once_the_reclaimed_trees_listener_is_gone() {
    let old = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
    let addr = old.local_addr().unwrap();
    let closing = tokio::spawn(async move {
        tokio::time::sleep(Duration::from_millis(300)).await;
        drop(old);
    });
    let listeners = super::wake::listen_on("w", &[addr]).await;
    closing.await.unwrap();
    assert_eq!(listeners.iter().map(|(_, a)| *a).collect::<Vec<_>>(), [addr]);
    std::net::TcpStream::connect(addr).expect("the waker's listener takes connections");
}
