//! Failure paths the kernel seam makes testable without root: what the engine's jobs do when
//! the host refuses a cgroup, a spawn or an install, holds a port a restore needs, or cannot
//! remove CRIU's network lock, run on [`FakeHost`] (rollback_tests' rig).

use std::path::PathBuf;

use nix::sys::signal::Signal;

use super::Host;
use super::fake::FakeHost;
use crate::criu::NetworkLock;
use crate::criu::fake::FakeCriu;
use crate::cuda::fake::FakeGpu;
use crate::engine::rollback_tests::{Extras, ROOT, Rig, quiet, rig, rig_with};
use crate::engine::sockets::record;
use crate::engine::{Caller, Pids, RunParams};
use crate::engine::{CheckpointError, CheckpointParams, RestoreError, RunError, Target};
use crate::linux::net::SocketEntry;
use crate::linux::net::SocketKind;

/// Where the rig's cgroup of workload `name` is.
fn cgroup_of(r: &Rig, name: &str) -> PathBuf {
    PathBuf::from(format!("/fake/cgroup/stasis/{}/{name}", r.engine.deps.store.node_tag()))
}

fn cgroups(host: &FakeHost) -> Vec<PathBuf> {
    host.cgroups.lock().unwrap().keys().cloned().collect()
}

/// Whether CRIU was asked to restore anything.
fn criu_restored(r: &Rig) -> bool {
    r.criu.calls().iter().any(|c| c.starts_with("restore"))
}

/// Starts `name` (the rig's tree, rooted at `ROOT`) with stasisd's pids.
fn run(r: &Rig, name: &str) -> Result<i32, RunError> {
    let params = RunParams {
        workload: Some(name.into()),
        argv: vec!["/bin/fake".into(), "--serve".into()],
        pids: Pids::Host,
        ..Default::default()
    };
    r.engine.run(params).map(|outcome| outcome.pid)
}

#[tokio::test]
async fn a_run_whose_cgroup_cannot_be_made_starts_nothing() {
    let r = rig(FakeCriu::default(), FakeGpu::default());
    r.host.fail("create_cgroup");
    let err = run(&r, "web").unwrap_err();
    assert!(matches!(&err, RunError::Setup { what: "its cgroup", .. }), "{err}");
    assert!(r.host.spawned.lock().unwrap().is_empty(), "nothing spawned");
    assert!(r.engine.registry.get("web").is_none(), "nothing registered");
}

#[tokio::test]
async fn a_run_whose_spawn_fails_gives_its_cgroup_back() {
    let r = rig(FakeCriu::default(), FakeGpu::default());
    r.host.fail("spawn");
    let err = run(&r, "web").unwrap_err();
    assert!(matches!(&err, RunError::Spawn { program, .. } if program == "/bin/fake"), "{err}");
    assert!(cgroups(&r.host).is_empty(), "the empty cgroup is removed");
    assert!(r.engine.registry.get("web").is_none(), "nothing registered");

    // Once spawning works, the tree sits in the cgroup, which stays.
    r.host.failing.lock().unwrap().clear();
    assert_eq!(run(&r, "web").unwrap(), ROOT);
    assert_eq!(*r.host.spawned.lock().unwrap(), [vec!["/bin/fake".to_string(), "--serve".into()]]);
    let cgroup = cgroup_of(&r, "web");
    assert_eq!(r.host.cgroups.lock().unwrap().get(&cgroup), Some(&vec![ROOT]));
    assert_eq!(r.engine.registry.get("web").unwrap().cgroup, Some(cgroup));
}

#[tokio::test]
async fn a_run_whose_init_cannot_be_installed_starts_nothing() {
    let r = rig(FakeCriu::default(), FakeGpu::default());
    r.host.fail("init_program");
    let params = RunParams {
        workload: Some("web".into()),
        argv: vec!["/bin/fake".into()],
        pids: Pids::Own,
        ..Default::default()
    };
    let err = r.engine.run(params).unwrap_err();
    assert!(matches!(&err, RunError::Setup { what: "its init", .. }), "{err}");
    assert!(r.host.spawned.lock().unwrap().is_empty(), "nothing spawned");
    assert!(cgroups(&r.host).is_empty(), "the empty cgroup is removed");
}

/// The rig's tree started as workload `web` (in a cgroup), evicted; returns its checkpoint.
async fn evicted_web(r: &Rig) -> String {
    run(r, "web").unwrap();
    let params = CheckpointParams {
        target: Target::Workload("web".into()),
        leave_running: false,
        answer_early: None,
        reclaim: None,
        caller: Caller::Root,
    };
    let id = r.engine.checkpoint(params, quiet()).await.unwrap().id;
    assert!(cgroups(&r.host).is_empty(), "the evicted tree's cgroup is gone");
    id
}

#[tokio::test]
async fn a_restore_whose_cgroup_cannot_be_made_restores_nothing() {
    let r = rig(FakeCriu::default(), FakeGpu::default());
    let id = evicted_web(&r).await;
    r.host.fail("create_cgroup");
    let err = r.restore(&id).await.unwrap_err();
    assert!(matches!(&err, RestoreError::Local { what: "its cgroup", .. }), "{err}");
    assert!(!criu_restored(&r), "CRIU was not asked to restore");
    assert!(!r.host.is_running(ROOT));

    // With its cgroup, the tree comes back, in it.
    r.host.failing.lock().unwrap().clear();
    assert_eq!(r.restore(&id).await.unwrap().pid, ROOT);
    assert_eq!(r.engine.registry.get("web").unwrap().cgroup, Some(cgroup_of(&r, "web")));
}

#[tokio::test]
async fn a_restore_whose_init_cannot_be_installed_gives_the_cgroup_back() {
    let r = rig(FakeCriu::default(), FakeGpu::default());
    let id = evicted_web(&r).await;
    r.host.fail("install_init_programs");
    let err = r.restore(&id).await.unwrap_err();
    assert!(matches!(&err, RestoreError::Local { what: "the checkpoint's stasis-init", .. }), "{err}");
    assert!(!criu_restored(&r), "CRIU was not asked to restore");
    assert!(cgroups(&r.host).is_empty(), "the cgroup made for the tree is removed");
}

#[tokio::test]
async fn a_restore_whose_port_is_taken_here_is_refused_before_criu_and_gives_the_cgroup_back() {
    let r = rig(FakeCriu::default(), FakeGpu::default());
    let listener = record("tcp", "listen", "127.0.0.1:8080", "");
    r.host.trees.lock().unwrap().get_mut(&ROOT).unwrap().sockets.records.push(listener);
    let id = evicted_web(&r).await;
    // Another process of this node listens there now.
    let taken = SocketEntry {
        kind: SocketKind::Tcp,
        state: "listen",
        local: Some("0.0.0.0:8080".parse().unwrap()),
        remote: None,
        path: None,
        listening: false,
        queued: 0,
    };
    r.host.namespace_sockets.lock().unwrap().insert(77, (taken, 4242));
    let err = r.restore(&id).await.unwrap_err();
    let RestoreError::Sockets { reason, .. } = &err else { panic!("{err}") };
    assert!(
        reason.contains("port 8080/tcp") && reason.contains("in use by pid 4242 (fake-4242)"),
        "{reason}"
    );
    assert!(!criu_restored(&r), "CRIU was not asked to restore");
    assert!(cgroups(&r.host).is_empty(), "the cgroup made for the tree is removed");

    r.host.namespace_sockets.lock().unwrap().clear();
    assert_eq!(r.restore(&id).await.unwrap().pid, ROOT);
}

#[tokio::test]
async fn a_rollback_whose_network_unlock_fails_says_so_and_still_continues_the_tree() {
    let extras = Extras { network_lock: Some(NetworkLock::Iptables), ..Default::default() };
    let r = rig_with(FakeCriu::default(), FakeGpu::default(), extras);
    r.host.trees.lock().unwrap().get_mut(&ROOT).unwrap().options.tcp_established = true;
    // CRIU leaves the tree's connection in repair mode, locked by its iptables rules, which
    // cannot be deleted here.
    let (local, remote) = ("10.0.0.1:40000".parse().unwrap(), "10.0.0.2:80".parse().unwrap());
    r.host.in_repair.lock().unwrap().push((local, remote));
    r.host.fail("run_iptables");
    r.break_store();
    let err = r.checkpoint(false).await.unwrap_err();
    let CheckpointError::Rollback { cause, problems } = &err else { panic!("{err}") };
    assert!(matches!(**cause, CheckpointError::Store { .. }), "{cause}");
    assert_eq!(problems.len(), 2, "{problems:?}");
    for problem in problems {
        assert!(
            problem.starts_with("connection 10.0.0.1:40000 -> 10.0.0.2:80 stays locked: cannot run iptables"),
            "{problem}"
        );
    }
    // Both rules of the connection were to go: packets from the peer, and to it.
    let tried = r.host.locks.iptables.lock().unwrap().clone();
    let rules: Vec<String> = tried.iter().map(|argv| argv.join(" ")).collect();
    assert_eq!(rules.len(), 2, "{rules:?}");
    assert!(rules[0].starts_with("iptables -w -t filter -D INPUT") && rules[0].contains("--sport 80"));
    assert!(rules[1].starts_with("iptables -w -t filter -D OUTPUT") && rules[1].contains("--dport 80"));
    // The tree is given back all the same: continued, its CUDA state back, nothing killed.
    assert_eq!(r.host.signals_of(Signal::SIGCONT), [ROOT]);
    assert!(r.host.signals_of(Signal::SIGKILL).is_empty());
    let expected = ["lock", "checkpoint", "restore", "unlock"].map(|c| format!("{c} {ROOT}"));
    assert_eq!(r.gpu.calls(), expected);
    assert_eq!(r.checkpoints().await, 0);
    assert_eq!(r.held_records(), 0);
}
