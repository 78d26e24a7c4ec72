//! The checkpoint and restore jobs' failure paths, run against fakes of CRIU, the kernel and
//! the GPU driver (and a real file store in a temporary directory): what each failure leaves
//! behind is checked call by call.

use std::sync::Arc;
use std::time::Duration;

use nix::sys::signal::Signal;
use tempfile::TempDir;

use super::host::fake::FakeHost;
use super::idle::GpuWatch;
use super::inspect::TreeInfo;
use super::parts::Deps;
use super::start::CriuSupport;
use super::state::StateDir;
use super::workloads::Registry;
use super::{
    Caller, CheckpointError, CheckpointOutcome, CheckpointParams, Engine, EngineConfig, GpuActivity,
    ProgressFn, RestoreError, RestoreParams, RestoreTarget, Settings, Target,
};
use crate::criu::fake::FakeCriu;
use crate::criu::{NetworkLock, TreeOptions};
use crate::cuda::fake::FakeGpu;
use crate::linux::reaper::Reaper;
use crate::store::{FetchSettings, Store};

/// Pids above Linux's largest possible pid_max: no real process can have them, so nothing
/// the jobs do to them can reach a real process.
pub(super) const ROOT: i32 = 4_194_401;
pub(super) const CHILD: i32 = 4_194_402;

pub(super) struct Rig {
    pub(super) engine: Arc<Engine>,
    pub(super) host: Arc<FakeHost>,
    pub(super) criu: Arc<FakeCriu>,
    pub(super) gpu: Arc<FakeGpu>,
    dir: TempDir,
}

/// What a rig may have other than its defaults.
#[derive(Default)]
pub(super) struct Extras {
    /// The store (else a file store in the rig's directory).
    pub(super) store: Option<Store>,
    /// Which processes use a GPU (else none is known to).
    pub(super) gpu_activity: Option<Arc<dyn GpuActivity>>,
    /// How CRIU locks connections here (else with nftables).
    pub(super) network_lock: Option<NetworkLock>,
    /// The processes of the tree with CUDA loaded (else its root).
    pub(super) cuda: Option<Vec<i32>>,
    /// Whether dumps track dirty pages (else the kernel is said to lack soft-dirty).
    pub(super) memory_tracking: bool,
}

/// A two-process tree whose root uses CUDA, with `CHILD` already stopped before any
/// checkpoint (job control). `criu` gets hooks that stop the tree on a dump (as CRIU's
/// leave-stopped does) and start it on a restore.
pub(super) fn rig(criu: FakeCriu, gpu: FakeGpu) -> Rig {
    rig_with(criu, gpu, Extras::default())
}

/// [`rig`], with `extras`.
pub(super) fn rig_with(mut criu: FakeCriu, gpu: FakeGpu, extras: Extras) -> Rig {
    let tree = TreeInfo {
        pids: vec![ROOT, CHILD],
        command: vec!["fake".into()],
        options: TreeOptions::default(),
        sockets: Default::default(),
        uids: [0].into(),
        started: [(ROOT, 1), (CHILD, 1)].into(),
        ns_pids: Vec::new(),
        open_files: Default::default(),
        init_dir: None,
        init_program: None,
        unsupported: None,
    };
    let host = Arc::new(FakeHost { cuda: extras.cuda.unwrap_or(vec![ROOT]), ..FakeHost::with_tree(tree) });
    host.stopped.lock().unwrap().insert(CHILD);
    let on_dump = host.clone();
    // The test's own hook, if any, runs after the rig's.
    let test_hook = criu.on_dump.take();
    criu.on_dump = Some(Box::new(move |spec| {
        if spec.leave_stopped {
            on_dump.stopped.lock().unwrap().extend([ROOT, CHILD]);
        }
        if let Some(hook) = &test_hook {
            hook(spec);
        }
    }));
    let on_restore = host.clone();
    criu.on_restore = Some(Box::new(move |_| on_restore.running.lock().unwrap().extend([ROOT, CHILD])));
    criu.restored_pid = ROOT;
    let (criu, gpu) = (Arc::new(criu), Arc::new(gpu));
    let dir = tempfile::tempdir().unwrap();
    let config = EngineConfig {
        state_dir: dir.path().join("state"),
        store_url: format!("file://{}", dir.path().join("store").display()),
        criu_path: "/fake/criu".into(),
        staging_limit: Some(64 << 20),
        compression: Default::default(),
        store_retry: Duration::ZERO,
        settings: Settings {
            keep_last: None,
            lazy: FetchSettings {
                cache_bytes: 64 << 20,
                prefetch_bytes: 64 << 20,
                timeout: Duration::from_secs(5),
                fresh_first: false,
            },
            notice_window: Some(Duration::from_secs(30)),
            ..Default::default()
        },
        ..Default::default()
    };
    let state = StateDir::open(&config.state_dir).unwrap();
    let support = CriuSupport {
        version: criu.version,
        network_sockets: Ok(()),
        network_lock: Ok(extras.network_lock.unwrap_or(NetworkLock::Nftables)),
        served_memory: Ok(()),
        memory_tracking: match extras.memory_tracking {
            true => Ok(()),
            false => Err("no soft-dirty in the fake kernel".into()),
        },
    };
    let registry = Registry::load(&state.registry_file()).unwrap();
    let deps = Deps {
        criu: criu.clone(),
        host: host.clone(),
        gpu: Some(gpu.clone()),
        gpu_activity: extras.gpu_activity.map(GpuWatch::new),
        store: extras.store.unwrap_or_else(|| Store::open(&config.store_url, config.store_retry).unwrap()),
        state,
        // A reaper that reaps nothing: a real one would take the exits of other tests' children.
        reaper: Reaper::default(),
    };
    let engine = Arc::new(Engine::assemble(deps, support, registry, &config));
    Rig { engine, host, criu, gpu, dir }
}

pub(super) fn quiet() -> ProgressFn {
    Arc::new(|_| {})
}

impl Rig {
    pub(super) async fn checkpoint(&self, leave_running: bool) -> Result<CheckpointOutcome, CheckpointError> {
        let params = CheckpointParams {
            target: Target::Pid(ROOT),
            leave_running,
            answer_early: None,
            reclaim: None,
            caller: Caller::Root,
        };
        self.engine.checkpoint(params, quiet()).await
    }

    pub(super) async fn restore(&self, id: &str) -> Result<super::RestoreOutcome, RestoreError> {
        let params = RestoreParams {
            target: RestoreTarget::Checkpoint(id.into()),
            gpu_map: Vec::new(),
            lazy: false,
            tcp_close: false,
            on_running: None,
            caller: Caller::Root,
            as_workload: None,
            into: None,
        };
        self.engine.restore(params, quiet()).await
    }

    /// Makes every upload to the file store fail: a file where its packs go.
    pub(super) fn break_store(&self) {
        self.block("packs");
    }

    /// Makes every commit fail, even of a checkpoint with nothing new to upload: a file where
    /// the manifests go (earlier manifests are lost with their directory).
    pub(super) fn break_commits(&self) {
        self.block("manifests");
    }

    /// Undoes [`Self::break_commits`] (the manifests it lost stay lost).
    pub(super) fn mend_commits(&self) {
        let path = self.dir.path().join("store/manifests");
        std::fs::remove_file(&path).unwrap();
        std::fs::create_dir(path).unwrap();
    }

    fn block(&self, dir: &str) {
        let path = self.dir.path().join("store").join(dir);
        let _ = std::fs::remove_dir_all(&path);
        std::fs::create_dir_all(path.parent().unwrap()).unwrap();
        std::fs::write(path, b"in the way").unwrap();
    }

    /// Records of held trees left in the state directory (none once a job has settled).
    pub(super) fn held_records(&self) -> usize {
        std::fs::read_dir(self.dir.path().join("state/held")).map(|d| d.count()).unwrap_or(0)
    }

    pub(super) async fn checkpoints(&self) -> usize {
        self.engine.list(None, Caller::Root).await.unwrap().checkpoints.len()
    }
}

#[tokio::test]
async fn an_eviction_whose_storing_fails_gives_the_tree_back_as_it_was() {
    let r = rig(FakeCriu::default(), FakeGpu::default());
    r.break_store();
    let err = r.checkpoint(false).await.unwrap_err();
    assert!(matches!(err, CheckpointError::Store { .. }), "{err}");
    // Connections out of repair mode, the processes CRIU stopped continued (the one stopped
    // before stays stopped), the CUDA state put back; nothing killed, nothing stored.
    assert_eq!(*r.host.repairs.lock().unwrap(), 1);
    assert_eq!(r.host.signals_of(Signal::SIGCONT), [ROOT]);
    assert!(r.host.signals_of(Signal::SIGKILL).is_empty());
    let expected = ["lock", "checkpoint", "restore", "unlock"].map(|c| format!("{c} {ROOT}"));
    assert_eq!(r.gpu.calls(), expected);
    assert_eq!(r.checkpoints().await, 0);
    assert_eq!(r.held_records(), 0);
}

#[tokio::test]
async fn a_failed_gpu_checkpoint_rolls_back_and_leaves_no_record() {
    let r = rig(FakeCriu::default(), FakeGpu { fail_checkpoint_of: Some(ROOT), ..Default::default() });
    let err = r.checkpoint(false).await.unwrap_err();
    assert!(matches!(err, CheckpointError::Gpu(_)), "{err}");
    assert!(r.criu.calls().is_empty(), "nothing may be dumped");
    assert!(r.host.signals.lock().unwrap().is_empty());
    assert_eq!(r.held_records(), 0, "a record left behind would be settled at the next start");
}

#[tokio::test]
async fn device_files_left_open_by_the_gpu_checkpoint_are_refused_before_criu() {
    let r = rig(FakeCriu::default(), FakeGpu::default());
    r.host.device_holders.lock().unwrap().push(ROOT);
    let err = r.checkpoint(false).await.unwrap_err();
    assert!(
        crate::error_chain(&err).contains("still hold NVIDIA device files"),
        "{}",
        crate::error_chain(&err)
    );
    assert!(r.criu.calls().is_empty(), "CRIU was not asked to dump");
    let calls = ["lock", "checkpoint", "restore", "unlock"].map(|c| format!("{c} {ROOT}"));
    assert_eq!(r.gpu.calls(), calls, "the CUDA state is put back");
    assert_eq!(r.held_records(), 0);
}

#[tokio::test]
async fn a_failed_dump_puts_the_cuda_state_back_and_touches_nothing_else() {
    let criu =
        FakeCriu { fail_dump: Some("Error (criu/sk-inet.c:1): injected".into()), ..Default::default() };
    let r = rig(criu, FakeGpu::default());
    let err = r.checkpoint(false).await.unwrap_err();
    assert!(matches!(err, CheckpointError::Dump { .. }), "{err}");
    assert!(crate::error_chain(&err).contains("injected"), "{}", crate::error_chain(&err));
    assert!(r.host.signals_of(Signal::SIGKILL).is_empty());
    assert!(r.host.signals_of(Signal::SIGCONT).is_empty(), "CRIU never stopped the tree");
    assert_eq!(r.gpu.calls().last().map(String::as_str), Some(format!("unlock {ROOT}").as_str()));
    assert_eq!(r.checkpoints().await, 0);
}

#[tokio::test]
async fn a_dump_whose_processes_die_with_it_says_they_are_lost() {
    // As when CRIU is killed while its parasite runs in the tree: the tree dies of its trap.
    let host: Arc<std::sync::OnceLock<Arc<FakeHost>>> = Default::default();
    let dying = host.clone();
    let criu = FakeCriu {
        fail_dump: Some("Error: CRIU exited before answering".into()),
        on_failed_dump: Some(Box::new(move |_| dying.get().unwrap().running.lock().unwrap().clear())),
        ..Default::default()
    };
    let r = rig(criu, FakeGpu::default());
    host.set(r.host.clone()).ok().unwrap();
    let err = r.checkpoint(false).await.unwrap_err();
    assert!(matches!(err, CheckpointError::Lost { .. }), "{err}");
    assert!(err.to_string().contains("died with the dump"), "{err}");
    assert!(r.host.signals_of(Signal::SIGKILL).is_empty());
    assert_eq!(r.held_records(), 0);
}

#[tokio::test]
async fn a_leave_running_checkpoint_whose_storing_fails_resumes_the_gpu_once() {
    let r = rig(FakeCriu::default(), FakeGpu::default());
    r.break_store();
    let err = r.checkpoint(true).await.unwrap_err();
    assert!(matches!(err, CheckpointError::Store { .. }), "{err}");
    // The GPU state went back right after the dump; the rollback must not do it again.
    let expected = ["lock", "checkpoint", "restore", "unlock"].map(|c| format!("{c} {ROOT}"));
    assert_eq!(r.gpu.calls(), expected);
    assert!(r.host.signals_of(Signal::SIGKILL).is_empty());
    assert_eq!(r.held_records(), 0);
}

#[tokio::test]
async fn a_leave_running_checkpoint_holds_nothing_once_the_tree_runs_again() {
    let r = rig(FakeCriu::default(), FakeGpu::default());
    let ck = r.checkpoint(true).await.unwrap();
    assert!(ck.durable && ck.left_running);
    assert!(r.host.signals.lock().unwrap().is_empty(), "a tree left running is neither continued nor killed");
    assert_eq!(r.held_records(), 0, "a record would have a restart kill or continue a running tree");
}

#[tokio::test]
async fn a_stored_eviction_kills_the_tree_and_a_restore_whose_gpu_step_fails_kills_it_again() {
    let gpu = FakeGpu { fail_restore_of: Some(ROOT), ..Default::default() };
    let r = rig(FakeCriu::default(), gpu);
    let ck = r.checkpoint(false).await.unwrap();
    assert!(ck.durable && !ck.left_running);
    assert_eq!(r.host.signals_of(Signal::SIGKILL), [ROOT, CHILD]);
    assert_eq!(r.checkpoints().await, 1);

    r.host.signals.lock().unwrap().clear();
    let err = r.restore(&ck.id).await.unwrap_err();
    assert!(matches!(err, RestoreError::Gpu { .. }), "{err}");
    assert_eq!(r.criu.calls().iter().filter(|c| c.starts_with("restore")).count(), 1);
    // The whole restored tree goes: a job without its GPU state must not run on.
    assert_eq!(r.host.signals_of(Signal::SIGKILL), [ROOT, CHILD]);
    assert!(r.host.running.lock().unwrap().is_empty());
}

#[tokio::test]
async fn a_restore_criu_refuses_leaves_nothing_to_kill_and_the_checkpoint_whole() {
    let criu =
        FakeCriu { fail_restore: Some("Error (criu/cr-restore.c:1): injected".into()), ..Default::default() };
    let r = rig(criu, FakeGpu::default());
    let ck = r.checkpoint(false).await.unwrap();
    r.host.signals.lock().unwrap().clear();
    let err = r.restore(&ck.id).await.unwrap_err();
    assert!(matches!(err, RestoreError::Criu { .. }), "{err}");
    assert!(r.host.signals.lock().unwrap().is_empty(), "CRIU removes what it could not restore");
    assert_eq!(r.checkpoints().await, 1);
}

/// An idle reclaim of the tree; `used`: the workload was used while it was checkpointed.
async fn reclaim(r: &Rig, used: bool) -> CheckpointOutcome {
    let uses = crate::engine::idle::ReclaimUses::default();
    uses.seen.store(used, std::sync::atomic::Ordering::SeqCst);
    let params = CheckpointParams {
        target: Target::Pid(ROOT),
        leave_running: false,
        answer_early: None,
        reclaim: Some(Arc::new(uses)),
        caller: Caller::Root,
    };
    r.engine.checkpoint(params, quiet()).await.unwrap()
}

#[tokio::test]
async fn a_reclaim_the_workload_interrupts_gives_the_stored_tree_back() {
    let r = rig(FakeCriu::default(), FakeGpu::default());
    let ck = reclaim(&r, true).await;
    assert!(ck.durable && ck.left_running, "{ck:?}");
    assert_eq!(r.checkpoints().await, 1, "the checkpoint is kept");
    assert!(r.host.signals_of(Signal::SIGKILL).is_empty(), "nothing killed");
    assert_eq!(r.host.signals_of(Signal::SIGCONT), [ROOT], "what CRIU stopped runs again");
    assert_eq!(*r.host.repairs.lock().unwrap(), 1, "its connections out of repair mode");
    let expected = ["lock", "checkpoint", "restore", "unlock"].map(|c| format!("{c} {ROOT}"));
    assert_eq!(r.gpu.calls(), expected, "its CUDA state back");
    assert_eq!(r.held_records(), 0);
}

#[tokio::test]
async fn a_reclaim_nobody_interrupts_stops_the_tree() {
    let r = rig(FakeCriu::default(), FakeGpu::default());
    let ck = reclaim(&r, false).await;
    assert!(ck.durable && !ck.left_running, "{ck:?}");
    assert_eq!(r.host.signals_of(Signal::SIGKILL), [ROOT, CHILD]);
}

#[tokio::test]
async fn another_users_tree_and_checkpoints_are_refused_before_anything_is_touched() {
    let r = rig(FakeCriu::default(), FakeGpu::default());
    let user = Caller::from_ids(1000, 1000);
    let params = CheckpointParams {
        target: Target::Pid(ROOT),
        leave_running: true,
        answer_early: None,
        reclaim: None,
        caller: user,
    };
    let err = r.engine.checkpoint(params, quiet()).await.unwrap_err();
    assert!(matches!(err, CheckpointError::NotYours { .. }), "{err}");
    assert!(r.criu.calls().is_empty() && r.gpu.calls().is_empty(), "nothing dumped, nothing locked");

    let ck = r.checkpoint(true).await.unwrap();
    assert_eq!(
        r.engine.list(None, user).await.unwrap().checkpoints.len(),
        0,
        "root's checkpoint is not listed"
    );
    assert!(matches!(r.engine.show(&ck.id, user).await, Err(super::QueryError::NotYours(_))));
    assert!(matches!(r.engine.delete(&ck.id, user).await, Err(super::QueryError::NotYours(_))));
    assert!(matches!(r.engine.gc(None, user).await, Err(super::QueryError::RootOnly(_))));
    let params = RestoreParams {
        target: RestoreTarget::Checkpoint(ck.id.clone()),
        gpu_map: Vec::new(),
        lazy: false,
        tcp_close: false,
        on_running: None,
        caller: user,
        as_workload: None,
        into: None,
    };
    let err = r.engine.restore(params, quiet()).await.unwrap_err();
    assert!(matches!(err, RestoreError::NotYours(_)), "{err}");
    assert_eq!(r.checkpoints().await, 1, "and it is still there");
}

#[tokio::test]
async fn an_eviction_never_kills_a_process_that_took_over_a_pid_of_the_tree() {
    let r = rig(FakeCriu::default(), FakeGpu::default());
    // By the time the checkpoint is stored, the child has died (killed by someone else) and
    // another process has its pid.
    r.host.reused.lock().unwrap().insert(CHILD);
    let ck = r.checkpoint(false).await.unwrap();
    assert!(ck.durable);
    assert_eq!(r.host.signals_of(Signal::SIGKILL), [ROOT], "only the tree's own processes are killed");
}
