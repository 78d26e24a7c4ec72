//! The Kubernetes tests' node without a kubelet: containerd 1.7 with its CRI and NRI plugins
//! (tests/src/containerd.rs), driven through the CRI as a kubelet drives it. A pod on the
//! host's network runs a container that counts into the log the CRI names; the container
//! answers an exec (as a preStop hook would run), reports itself running with its pid, stops
//! on StopContainer within its grace period, and the pod goes. NRI listens on its socket.

#![forbid(unsafe_code)]

use std::time::Duration;

use stasis_proto::cri::{
    ContainerState, ContainerStatusRequest, CreateContainerRequest, ExecSyncRequest, RemovePodSandboxRequest,
    RunPodSandboxRequest, StartContainerRequest, StopContainerRequest, StopPodSandboxRequest,
};
use stasis_tests::containerd::Containerd;
use stasis_tests::kube::{container, pod};
use stasis_tests::podman::{IMAGE, Podman};
use stasis_tests::{TIMEOUT, expect_within, procfs, skip_unless_ready};

#[tokio::test(flavor = "multi_thread")]
async fn containerd_runs_execs_and_stops_a_pod_driven_through_the_cri() {
    skip_unless_ready!();
    let Some(podman) = Podman::start() else { return };
    let Some(containerd) = Containerd::start(&podman) else { return };
    let mut cri = containerd.cri().await;
    assert!(containerd.nri_socket().exists(), "NRI listens");
    let logs = containerd.dir().join("pods");
    std::fs::create_dir_all(&logs).unwrap();
    let config = pod("counter", &logs);
    let sandbox = cri
        .run_pod_sandbox(RunPodSandboxRequest {
            config: Some(config.clone()),
            runtime_handler: String::new(),
        })
        .await
        .unwrap_or_else(|e| panic!("RunPodSandbox: {e}\n{}", containerd.log_tail()))
        .into_inner()
        .pod_sandbox_id;
    let script =
        "trap 'echo stopping; exit 0' TERM; i=0; while true; do echo $i; i=$((i+1)); sleep 0.1; done";
    let container = container("count", IMAGE, &["/bin/sh", "-c", script]);
    let request = CreateContainerRequest {
        pod_sandbox_id: sandbox.clone(),
        config: Some(container),
        sandbox_config: Some(config),
    };
    let id = cri
        .create_container(request)
        .await
        .unwrap_or_else(|e| panic!("CreateContainer: {e}\n{}", containerd.log_tail()))
        .into_inner()
        .container_id;
    cri.start_container(StartContainerRequest { container_id: id.clone() }).await.expect("StartContainer");

    // It counts into the CRI's log (lines `<time> stdout F <text>`).
    let log = logs.join("count.log");
    let counted = || {
        std::fs::read_to_string(&log).unwrap_or_default().lines().filter(|l| l.contains(" stdout ")).count()
    };
    expect_within(TIMEOUT, "the container to count into its log", || (counted() >= 5).then_some(()));
    let status = cri
        .container_status(ContainerStatusRequest { container_id: id.clone(), verbose: true })
        .await
        .expect("ContainerStatus")
        .into_inner();
    assert_eq!(status.status.as_ref().map(|s| s.state), Some(ContainerState::ContainerRunning as i32));
    let info: serde_json::Value = serde_json::from_str(&status.info["info"]).expect("containerd's info");
    let pid = info["pid"].as_i64().expect("the container's pid") as i32;
    assert!(procfs::alive(pid), "pid {pid} of the container runs");

    // An exec, as a preStop hook runs.
    let exec = ExecSyncRequest {
        container_id: id.clone(),
        cmd: ["/bin/echo", "hook"].map(String::from).to_vec(),
        timeout: 10,
    };
    let out = cri.exec_sync(exec).await.expect("ExecSync").into_inner();
    assert_eq!((out.exit_code, String::from_utf8_lossy(&out.stdout).trim()), (0, "hook"));

    // SIGTERM within the grace period: the container's trap says so and it exits 0.
    cri.stop_container(StopContainerRequest { container_id: id.clone(), timeout: 10 })
        .await
        .expect("StopContainer");
    let status = cri.container_status(ContainerStatusRequest { container_id: id.clone(), verbose: false });
    let status = status.await.expect("ContainerStatus").into_inner().status.expect("a status");
    assert_eq!((status.state, status.exit_code), (ContainerState::ContainerExited as i32, 0), "{status:?}");
    assert!(std::fs::read_to_string(&log).unwrap_or_default().contains("stopping"));
    expect_within(Duration::from_secs(5), "the container's process to be gone", || {
        (!procfs::alive(pid)).then_some(())
    });
    cri.stop_pod_sandbox(StopPodSandboxRequest { pod_sandbox_id: sandbox.clone() })
        .await
        .expect("StopPodSandbox");
    cri.remove_pod_sandbox(RemovePodSandboxRequest { pod_sandbox_id: sandbox })
        .await
        .expect("RemovePodSandbox");
}
