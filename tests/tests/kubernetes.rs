//! Kubernetes: an opted-in container (its command run by stasis-pod, the pod bundle and the
//! pod endpoint mounted, as the webhook makes it) is evicted through its preStop hook, and a
//! new pod of the same identity continues its job. Driven through containerd's CRI as a
//! kubelet drives it (tests/src/kube.rs); the container is registered with stasisd as the NRI
//! plugin registers it.

#![forbid(unsafe_code)]

use std::path::Path;

use stasis_tests::containerd::Containerd;
use stasis_tests::kube::{Kubelet, RunningPod, bundle, container, opted_in, stasis_pod, stdout_lines};
use stasis_tests::podman::{IMAGE, Podman};
use stasis_tests::{Daemon, DaemonOptions, TIMEOUT, expect_within, skip_unless_ready};

/// Counts on stdout, one number every 100 ms, from 1: its state is in its memory alone.
const COUNTER: [&str; 3] = ["/bin/sh", "-c", "i=0; while true; do i=$((i+1)); echo $i; sleep 0.1; done"];

/// The numbers the pod's container wrote.
fn counted(pod: &RunningPod) -> Vec<u64> {
    stdout_lines(&pod.log).iter().filter_map(|l| l.trim().parse().ok()).collect()
}

/// Registers the pod's container with stasisd as StatefulSet `trainer`'s pod 0 running `image`.
async fn register(d: &Daemon, kubelet: &mut Kubelet<'_>, pod: &RunningPod, image: &str) -> String {
    let pid = kubelet.init_pid(pod).await.to_string();
    let args = [
        "container",
        "register",
        "--id",
        &pod.container,
        "--init-pid",
        &pid,
        "--image",
        image,
        "--namespace",
        "test",
        "--owner-kind",
        "StatefulSet",
        "--owner-name",
        "trainer",
        "--ordinal",
        "0",
        "--container",
        "main",
        "--json",
    ];
    d.json(&args)["workload"].as_str().expect("a workload name").to_owned()
}

fn daemon(endpoint: &Path) -> Daemon {
    let socket = endpoint.join("pod.sock").display().to_string();
    Daemon::start_with(&DaemonOptions { args: vec!["--pod-socket".into(), socket], ..Default::default() })
}

#[tokio::test(flavor = "multi_thread")]
async fn an_evicted_pod_continues_its_job_in_the_pod_that_replaces_it() {
    skip_unless_ready!();
    let Some(podman) = Podman::start() else { return };
    let Some(containerd) = Containerd::start(&podman) else { return };
    let endpoint = tempfile::tempdir().expect("endpoint directory");
    let d = daemon(endpoint.path());
    let bundle = bundle(d.dir());
    let mut kubelet = Kubelet::new(&containerd).await;
    let spec = || opted_in(container("main", IMAGE, &COUNTER), &bundle, endpoint.path());

    // The first pod starts afresh (no checkpoint yet) and counts.
    let first = kubelet.run("trainer-0", spec()).await;
    let workload = register(&d, &mut kubelet, &first, IMAGE).await;
    assert_eq!(workload, "k8s.test.statefulset.trainer.0.main");
    expect_within(TIMEOUT, "the first pod to count to 10", || (counted(&first).len() >= 10).then_some(()));
    assert_eq!(counted(&first)[..3], [1, 2, 3], "a fresh start");

    // Eviction: the kubelet runs the preStop hook, then stops the container.
    let (code, out, err) = kubelet.exec(&first, stasis_pod(&["prestop"]), 120).await;
    assert_eq!(code, 0, "preStop: {out}{err}\n{}", d.log_tail(40));
    assert!(out.contains("is durable"), "{out}");
    let last = *counted(&first).last().unwrap();
    std::thread::sleep(std::time::Duration::from_millis(500));
    assert_eq!(counted(&first).last(), Some(&last), "the evicted job stopped");
    let id = first.container.clone();
    kubelet.delete(first, 10).await;
    d.ok(&["container", "forget", &id]);

    // Its replacement, same identity and image: the job goes on from where it stopped.
    let second = kubelet.run("trainer-0-b", spec()).await;
    register(&d, &mut kubelet, &second, IMAGE).await;
    expect_within(TIMEOUT, "the second pod to count on", || (counted(&second).len() >= 5).then_some(()));
    let went_on = counted(&second);
    assert_eq!(went_on[0], last + 1, "continued from {last}: {went_on:?}\n{}", d.log_tail(40));
    assert!(went_on.windows(2).all(|w| w[1] == w[0] + 1), "{went_on:?}");
    let listed = d.json(&["list", "--workload", &workload, "--json"]);
    assert_eq!(listed["checkpoints"].as_array().map(Vec::len), Some(1), "{listed}");

    // A rollout to another image starts afresh, its checkpoint left alone.
    let (code, out, err) = kubelet.exec(&second, stasis_pod(&["prestop"]), 120).await;
    assert_eq!(code, 0, "preStop: {out}{err}");
    kubelet.delete(second, 10).await;
    let third = kubelet.run("trainer-0-c", spec()).await;
    register(&d, &mut kubelet, &third, "localhost/stasis-test-busybox:2").await;
    expect_within(TIMEOUT, "the third pod to count", || (counted(&third).len() >= 3).then_some(()));
    assert_eq!(counted(&third)[..3], [1, 2, 3], "a new image starts afresh");
    kubelet.delete(third, 10).await;
}
