//! Trees whose glibc registered restartable sequences (rseq), on a kernel where CRIU cannot
//! dump them (before 5.13) and on one where it can: refused before anything is touched there,
//! checkpointed here (`inspect::kernel_refusal`, through [`Host::inspect`]).

use super::Host;
use super::fake::FakeHost;
use crate::criu::fake::FakeCriu;
use crate::cuda::fake::FakeGpu;
use crate::engine::CheckpointError;
use crate::engine::inspect::{TreeInfo, kernel_refusal};
use crate::engine::rollback_tests::{CHILD, ROOT, rig};

const OLD: &str = "5.10.0-32-amd64";
const NEW: &str = "6.1.0-50-amd64";
const GLIBC: &[&str] = &["/usr/bin/python3.11", "/usr/lib/x86_64-linux-gnu/libc.so.6"];
const PLAIN: &[&str] = &["PATH=/usr/bin", "HOME=/root"];
const TUNED: &[&str] = &["PATH=/usr/bin", "GLIBC_TUNABLES=glibc.malloc.arena_max=2:glibc.pthread.rseq=0"];

/// A host on `release` running a tree of one process, `ROOT`, that maps `mapped` and started
/// with `environment`.
fn host(release: &str, mapped: &[&str], environment: &[&str]) -> FakeHost {
    let tree = TreeInfo {
        pids: vec![ROOT],
        command: vec!["python3".into()],
        options: Default::default(),
        sockets: Default::default(),
        uids: [0].into(),
        started: [(ROOT, 1)].into(),
        ns_pids: Vec::new(),
        open_files: Default::default(),
        init_dir: None,
        init_program: None,
        unsupported: None,
    };
    let host = FakeHost::with_tree(tree);
    host.programs.set_release(release);
    host.programs.set(ROOT, mapped, environment);
    host
}

#[test]
fn a_glibc_process_without_the_tunable_is_refused_before_5_13() {
    let why = host(OLD, GLIBC, PLAIN).inspect(ROOT).unwrap().unsupported.expect("refused");
    for named in [
        &format!("process {ROOT} (fake-{ROOT})"),
        "restartable sequences (rseq)",
        &format!("kernel {OLD} lacks PTRACE_GET_RSEQ_CONFIGURATION"),
        "`stasis run`",
        "GLIBC_TUNABLES=glibc.pthread.rseq=0",
        "Linux 5.13 or newer",
    ] {
        assert!(why.contains(named), "{named:?} not in: {why}");
    }
}

#[test]
fn the_tunable_a_static_program_or_a_newer_kernel_passes() {
    let passes =
        |release, mapped, environment| host(release, mapped, environment).inspect(ROOT).unwrap().unsupported;
    assert_eq!(passes(OLD, GLIBC, TUNED), None, "glibc.pthread.rseq=0");
    assert_eq!(passes(OLD, &["/usr/local/bin/static-server"], PLAIN), None, "a static program");
    assert_eq!(passes(OLD, &["/usr/bin/python3", "/lib/ld-musl-x86_64.so.1"], PLAIN), None, "musl");
    assert_eq!(passes(NEW, GLIBC, PLAIN), None, "Linux 6.1 dumps rseq");
    assert_eq!(passes("5.13.0", GLIBC, PLAIN), None, "from 5.13 on");
}

#[test]
fn the_kernel_is_asked_first_and_another_refusal_comes_first() {
    // On a kernel that dumps rseq, no process is read at all.
    let new = host(NEW, GLIBC, PLAIN);
    new.programs.mapped.lock().unwrap().clear();
    assert_eq!(kernel_refusal(&new, &[ROOT]), None);
    // A refusal found on any kernel stands.
    let old = host(OLD, GLIBC, PLAIN);
    old.trees.lock().unwrap().get_mut(&ROOT).unwrap().unsupported = Some("it holds an io_uring".into());
    assert_eq!(old.inspect(ROOT).unwrap().unsupported.as_deref(), Some("it holds an io_uring"));
}

#[tokio::test]
async fn a_checkpoint_of_such_a_tree_touches_nothing_on_5_10_and_dumps_it_on_6_1() {
    let r = rig(FakeCriu::default(), FakeGpu::default());
    r.host.programs.set_release(OLD);
    r.host.programs.set(ROOT, &["/usr/bin/bash", "/usr/lib/x86_64-linux-gnu/libc.so.6"], TUNED);
    r.host.programs.set(CHILD, GLIBC, PLAIN);
    let err = r.checkpoint(true).await.unwrap_err();
    match &err {
        CheckpointError::Untouchable { pid, reason } => {
            assert_eq!(*pid, ROOT);
            assert!(reason.starts_with(&format!("process {CHILD} ")), "the child is named: {reason}");
        }
        other => panic!("not refused up front: {other}"),
    }
    assert!(err.to_string().contains("nothing was touched"), "{err}");
    assert!(r.criu.calls().is_empty(), "CRIU never ran: {:?}", r.criu.calls());
    assert!(r.gpu.calls().is_empty(), "CUDA untouched: {:?}", r.gpu.calls());
    assert!(r.host.signals.lock().unwrap().is_empty(), "no signal sent");
    assert_eq!(r.checkpoints().await, 0);

    r.host.programs.set_release(NEW);
    r.checkpoint(true).await.expect("dumped where the kernel reads rseq");
    assert_eq!(r.checkpoints().await, 1);
}
