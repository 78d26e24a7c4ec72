//! A container's eviction and restore where the host refuses them, run on [`FakeHost`]
//! (rollback_tests' rig, its tree the one command of a container): what each failure leaves.

use super::restore::PodStart;
use super::{ContainerRef, Identity, Registration};
use crate::criu::fake::FakeCriu;
use crate::cuda::fake::FakeGpu;
use crate::engine::host::Containers;
use crate::engine::rollback_tests::{CHILD, Extras, ROOT, Rig, quiet, rig, rig_with};
use crate::engine::{CheckpointError, CheckpointOutcome, RestoreError};
use crate::error_chain;

/// The container's init (stasis-pod): above Linux's largest pid_max, like the rig's tree.
const INIT: i32 = 4_194_400;

/// The rig's tree as the one command of a registered container: its workload's name and the
/// container.
fn container(r: &Rig) -> (String, ContainerRef) {
    r.host.add_container(INIT, ROOT);
    let c = ContainerRef {
        id: "c0ffee".into(),
        init_pid: INIT,
        image: "web@sha256:1".into(),
        ..Default::default()
    };
    let identity = Identity {
        namespace: "default".into(),
        owner_kind: "StatefulSet".into(),
        owner_name: "web".into(),
        ordinal: "0".into(),
        container: "app".into(),
    };
    let registration = Registration { container: c.clone(), identity, checkpoint_every: None };
    (r.engine.register_container(registration).unwrap(), c)
}

/// The driver inside the rig's container.
fn container_gpu(r: &Rig) -> std::sync::Arc<FakeGpu> {
    r.host.containers.cuda.lock().unwrap()[&INIT].clone()
}

/// Evicts workload `name`'s tree, as its container's preStop hook asks.
async fn evict(r: &Rig, name: &str) -> Result<CheckpointOutcome, CheckpointError> {
    let w = r.engine.registry.get(name).unwrap();
    r.engine.evict_container(w, None, quiet()).await
}

/// Whether container workload `name` is marked evicting, and evicted.
fn marks(r: &Rig, name: &str) -> (bool, bool) {
    let c = r.engine.registry.get(name).unwrap().container.unwrap();
    (c.evicting, c.evicted)
}

fn criu_restored(r: &Rig) -> bool {
    r.criu.calls().iter().any(|c| c.starts_with("restore"))
}

#[tokio::test]
async fn an_eviction_whose_container_cannot_be_entered_fails_and_gives_the_tree_back() {
    let r = rig(FakeCriu::default(), FakeGpu::default());
    let (name, _) = container(&r);
    r.host.fail("ensure_tmp");
    let err = evict(&r, &name).await.unwrap_err();
    assert!(matches!(&err, CheckpointError::Local { what: "entering the container", .. }), "{err}");
    assert!(error_chain(&err).contains("Permission denied"), "{}", error_chain(&err));
    assert!(r.criu.calls().is_empty(), "CRIU was not asked to dump");
    // The tree runs on as it was: never stopped, nothing killed, its CUDA state back, all
    // through the driver inside the container, none through stasisd's own.
    assert!(r.host.signals.lock().unwrap().is_empty());
    assert_eq!(r.host.children(INIT), [ROOT]);
    let expected = ["lock", "checkpoint", "restore", "unlock"].map(|c| format!("{c} {ROOT}"));
    assert_eq!(container_gpu(&r).calls(), expected);
    assert!(r.gpu.calls().is_empty(), "stasisd's own driver is not asked about a container's processes");
    assert_eq!(r.checkpoints().await, 0);
    assert_eq!(r.held_records(), 0);
    assert_eq!(marks(&r, &name), (false, false), "the container is not marked evicted");

    // Once it can be entered, CRIU dumps the tree from inside it, and the tree goes.
    r.host.failing.lock().unwrap().clear();
    assert!(evict(&r, &name).await.unwrap().durable);
    assert_eq!(r.criu.calls(), [format!("dump {ROOT}")]);
    assert!(r.host.children(INIT).is_empty());
    assert_eq!(marks(&r, &name), (false, true));
}

/// The rig's container, its tree (without CUDA) evicted: the checkpoint stored, the tree
/// killed.
async fn evicted() -> (Rig, String, ContainerRef, String) {
    let r = rig_with(
        FakeCriu::default(),
        FakeGpu::default(),
        Extras { cuda: Some(Vec::new()), ..Default::default() },
    );
    let (name, c) = container(&r);
    let id = evict(&r, &name).await.unwrap().id;
    r.host.signals.lock().unwrap().clear();
    (r, name, c, id)
}

/// A restore into container `c` of workload `name` while host method `failing` fails: refused
/// before CRIU, naming why, with nothing left in the container.
async fn refused(r: &Rig, name: &str, c: &ContainerRef, failing: &'static str) {
    r.host.fail(failing);
    let err = r.engine.start_container(name, c, quiet()).await.unwrap_err();
    assert!(matches!(&err, RestoreError::Local { what: "entering the container", .. }), "{err}");
    assert!(error_chain(&err).contains("Permission denied"), "{}", error_chain(&err));
    assert!(!criu_restored(r), "CRIU was not asked to restore");
    assert!(r.host.children(INIT).is_empty(), "nothing runs in the container");
    assert!(r.host.signals.lock().unwrap().is_empty(), "nothing to kill");
    assert_eq!(r.checkpoints().await, 1, "the checkpoint stays");
    r.host.failing.lock().unwrap().clear();
}

/// The restore of checkpoint `id` into container `c` goes through: its root is the init's
/// child again.
async fn restored(r: &Rig, name: &str, c: &ContainerRef, id: &str) {
    let start = r.engine.start_container(name, c, quiet()).await.unwrap();
    assert_eq!(start, PodStart::Restored { checkpoint: id.into(), pid: ROOT });
    assert_eq!(r.host.children(INIT), [ROOT]);
}

#[tokio::test]
async fn a_container_restore_whose_pids_cannot_be_reserved_is_refused_before_criu() {
    let (r, name, c, id) = evicted().await;
    refused(&r, &name, &c, "reserve_pids").await;
    assert!(r.host.containers.reserved.lock().unwrap().is_empty());

    // Once they can, the container's next pids are set above every pid of the tree.
    restored(&r, &name, &c, &id).await;
    assert_eq!(*r.host.containers.reserved.lock().unwrap(), [(INIT, CHILD, vec![ROOT, CHILD])]);
}

#[tokio::test]
async fn a_container_restore_that_cannot_enter_the_container_is_refused_before_criu() {
    let (r, name, c, id) = evicted().await;
    refused(&r, &name, &c, "ensure_tmp").await;
    restored(&r, &name, &c, &id).await;
}

#[tokio::test]
async fn a_cuda_tree_goes_only_into_a_container_given_its_gpus_and_through_the_driver_there() {
    let r = rig(FakeCriu::default(), FakeGpu::default());
    let (name, mut c) = container(&r);
    let id = evict(&r, &name).await.unwrap().id;
    let dumped = ["lock", "checkpoint"].map(|call| format!("{call} {ROOT}"));
    assert_eq!(container_gpu(&r).calls(), dumped, "left checkpointed: the tree is gone");
    r.host.signals.lock().unwrap().clear();

    // A container without a GPU cannot take it: refused before CRIU, saying why.
    let err = r.engine.start_container(&name, &c, quiet()).await.unwrap_err();
    assert!(matches!(&err, RestoreError::Incompatible { .. }), "{err}");
    assert!(
        error_chain(&err).contains("used 1 GPU(s), and container c0ffee was given 0"),
        "{}",
        error_chain(&err)
    );
    assert!(!criu_restored(&r), "CRIU was not asked to restore");
    assert_eq!(r.checkpoints().await, 1, "the checkpoint stays");

    // One given a GPU takes it, and the CUDA state is put back inside it.
    c.gpu_devices = vec!["/dev/nvidia0".into()];
    restored(&r, &name, &c, &id).await;
    let all = ["lock", "checkpoint", "restore", "unlock"].map(|call| format!("{call} {ROOT}"));
    assert_eq!(container_gpu(&r).calls(), all);
    assert!(r.gpu.calls().is_empty(), "stasisd's own driver is not asked about a container's processes");
}
