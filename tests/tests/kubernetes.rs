//! Kubernetes: a StatefulSet's opted-in pod, admitted by stasis' webhook (owner annotated,
//! command run by stasis-pod, preStop hook, grace period), is evicted through its preStop hook,
//! and the pod of the same identity that replaces it continues its job. Driven through
//! containerd's CRI as a kubelet drives it (tests/src/kube.rs), with stasis-nri registered
//! with containerd's NRI: it injects the pod bundle and the endpoint and tells stasisd of the
//! container. Containers reach only themselves through the pod endpoint; an eviction whose
//! store fails leaves the job to stop as it would have without stasis. Nothing of a pod's image
//! (its CRIU plugins, its preloaded libraries, its configuration) runs in or steers the CRIU
//! stasisd runs in the container.

#![forbid(unsafe_code)]

use std::io::{BufRead, Write};
use std::path::Path;

use stasis_proto::cri::Mount;
use stasis_tests::containerd::{Containerd, NEXT_IMAGE};
use stasis_tests::disk::SmallDisk;
use stasis_tests::kube::{
    Kubelet, NriPlugin, RunningPod, admitted, bundle, grace, pre_stop, python_paths, startup_probe,
    stateful_pod, stdout_lines, translate, with_host_paths,
};
use stasis_tests::podman::{IMAGE, Podman};
use stasis_tests::preload::{loaders, marker_library, privileged_lines};
use stasis_tests::{Daemon, DaemonOptions, TIMEOUT, expect_within, skip_unless_ready, wait_for};

/// Counts on stdout, one number every 100 ms, from 1: its state is in its memory alone.
const COUNTER: [&str; 3] = ["/bin/sh", "-c", "i=0; while true; do i=$((i+1)); echo $i; sleep 0.1; done"];

/// The numbers the pod's container wrote.
fn counted(pod: &RunningPod) -> Vec<u64> {
    stdout_lines(&pod.log).iter().filter_map(|l| l.trim().parse().ok()).collect()
}

fn daemon(endpoint: &Path) -> Daemon {
    let socket = endpoint.join("pod.sock").display().to_string();
    Daemon::start_with(&DaemonOptions { args: vec!["--pod-socket".into(), socket], ..Default::default() })
}

/// The workload stasisd knows container `pod` by, once the NRI plugin registered it.
fn registered(d: &Daemon, nri: &NriPlugin, pod: &RunningPod) -> serde_json::Value {
    let found = wait_for(TIMEOUT, || {
        d.workloads().into_iter().find(|w| w["container"].as_str() == Some(pod.container.as_str()))
    });
    found.unwrap_or_else(|| {
        panic!("the NRI plugin did not register the container:\n{}\n{:?}", nri.log_text(), d.workloads())
    })
}

#[tokio::test(flavor = "multi_thread")]
async fn an_evicted_pod_continues_its_job_in_the_pod_that_replaces_it() {
    skip_unless_ready!();
    let Some(podman) = Podman::start() else { return };
    let Some(containerd) = Containerd::start(&podman) else { return };
    let endpoint = tempfile::tempdir().expect("endpoint directory");
    let d = daemon(endpoint.path());
    let nri = NriPlugin::start(&containerd, &d.socket(), &bundle(d.dir()), endpoint.path());
    let mut kubelet = Kubelet::new(&containerd).await;
    // The pods StatefulSet `trainer` makes for its ordinal 0, one after another.
    let trainer =
        |name: &str, image: &str| admitted(&stateful_pod(name, "trainer", "0", &[("main", image, &COUNTER)]));

    // The first pod starts afresh (no checkpoint yet) and counts.
    let pod = trainer("trainer-0", IMAGE);
    let (sandbox, main) = translate(&kubelet, &pod);
    let first = kubelet.run(sandbox, main).await;
    let workload = registered(&d, &nri, &first)["name"].as_str().unwrap().to_owned();
    assert_eq!(workload, "k8s.test.statefulset.trainer.0.main");
    expect_within(TIMEOUT, "the first pod to count to 10", || (counted(&first).len() >= 10).then_some(()));
    assert_eq!(counted(&first)[..3], [1, 2, 3], "a fresh start");

    // Eviction: the kubelet runs the preStop hook, then stops the container.
    let (code, out, err) = kubelet.exec(&first, pre_stop(&pod), grace(&pod)).await;
    let logged = std::fs::read_to_string(&first.log).unwrap_or_default();
    assert_eq!(code, 0, "preStop: {out}{err}\n{}\n{logged}", d.log_tail(40));
    assert!(out.contains("is durable"), "{out}");
    let last = *counted(&first).last().unwrap();
    std::thread::sleep(std::time::Duration::from_millis(500));
    assert_eq!(counted(&first).last(), Some(&last), "the evicted job stopped");
    kubelet.delete(first, grace(&pod)).await;

    // Its replacement, same identity and image: the job goes on from where it stopped.
    let pod = trainer("trainer-0", IMAGE);
    let (sandbox, main) = translate(&kubelet, &pod);
    let second = kubelet.run(sandbox, main).await;
    expect_within(TIMEOUT, "the second pod to count on", || (counted(&second).len() >= 5).then_some(()));
    let went_on = counted(&second);
    assert_eq!(went_on[0], last + 1, "continued from {last}: {went_on:?}\n{}", d.log_tail(40));
    assert!(went_on.windows(2).all(|w| w[1] == w[0] + 1), "{went_on:?}");
    let log = d.log_tail(400);
    assert!(
        log.contains("lazily restored tree runs"),
        "a hot restore, the tree running before its memory is in:\n{log}"
    );
    let probe = startup_probe(&pod);
    assert_eq!(kubelet.exec(&second, probe, 10).await.0, 0, "the startup probe passes once the job runs");
    let listed = d.json(&["list", "--workload", &workload, "--json"]);
    assert_eq!(listed["checkpoints"].as_array().map(Vec::len), Some(1), "{listed}");

    // A rollout to another image starts afresh, its checkpoint left alone.
    let (code, out, err) = kubelet.exec(&second, pre_stop(&pod), grace(&pod)).await;
    assert_eq!(code, 0, "preStop: {out}{err}");
    kubelet.delete(second, grace(&pod)).await;
    let pod = trainer("trainer-0", NEXT_IMAGE);
    let (sandbox, main) = translate(&kubelet, &pod);
    let third = kubelet.run(sandbox, main).await;
    expect_within(TIMEOUT, "the third pod to count", || (counted(&third).len() >= 3).then_some(()));
    assert_eq!(counted(&third)[..3], [1, 2, 3], "a new image starts afresh\n{}", nri.log_text());
    // Unless the pod says any image will do: the checkpoint of the image before goes on.
    let (code, out, err) = kubelet.exec(&third, pre_stop(&pod), grace(&pod)).await;
    assert_eq!(code, 0, "preStop: {out}{err}");
    let last = *counted(&third).last().unwrap();
    kubelet.delete(third, grace(&pod)).await;
    let mut any = stateful_pod("trainer-0", "trainer", "0", &[("main", IMAGE, &COUNTER)]);
    any["metadata"]["annotations"] = serde_json::json!({ "stasis.dev/any-image": "true" });
    let pod = admitted(&any);
    let (sandbox, main) = translate(&kubelet, &pod);
    let fourth = kubelet.run(sandbox, main).await;
    expect_within(TIMEOUT, "the fourth pod to count", || (!counted(&fourth).is_empty()).then_some(()));
    assert_eq!(counted(&fourth)[0], last + 1, "restored across images");
    kubelet.delete(fourth, grace(&pod)).await;
    assert!(nri.log_text().contains("injecting stasis"), "{}", nri.log_text());
    assert!(nri.log_text().contains("image=sha256:"), "images are known by digest: {}", nri.log_text());
}

/// Where the pod's image keeps CRIU plugins and the library its /etc/ld.so.preload names, and
/// where that library writes who loaded it.
const PLUGINS: &str = "/usr/lib/criu";
const MARK_OUT: &str = "/opt/mark-out";

#[tokio::test(flavor = "multi_thread")]
async fn nothing_of_a_pod_s_image_runs_in_the_criu_stasisd_runs_in_its_container() {
    skip_unless_ready!();
    let Some(podman) = Podman::start() else { return };
    let Some(containerd) = Containerd::start(&podman) else { return };
    let endpoint = tempfile::tempdir().expect("endpoint directory");
    let d = daemon(endpoint.path());
    let nri = NriPlugin::start(&containerd, &d.socket(), &bundle(d.dir()), endpoint.path());
    let mut kubelet = Kubelet::new(&containerd).await;
    // The image has a CRIU plugin in CRIU's default plugin directory, and preloads it into every
    // program its loader starts: a CRIU that loaded either would run it as root on the node.
    let mark = tempfile::tempdir().expect("a directory for the library");
    let loaded_by = tempfile::tempdir().expect("a directory for the library's marker");
    marker_library(mark.path(), &Path::new(MARK_OUT).join("loaded-by"));
    let preload = mark.path().join("ld.so.preload");
    std::fs::write(&preload, format!("{PLUGINS}/mark.so\n")).unwrap();
    // And a CRIU configuration file naming that plugin directory: CRIU reads its default
    // configuration (/etc/criu/default.conf) wherever its root is.
    let config = tempfile::tempdir().expect("a directory for the configuration");
    std::fs::write(config.path().join("default.conf"), format!("libdir {PLUGINS}\n")).unwrap();
    // And a cache of kernel facts where CRIU looks for one: CRIU would load it (this one is
    // stale, so CRIU would delete it as root) or save its own there.
    let run = tempfile::tempdir().expect("a directory for /run");
    let facts = run.path().join("criu.kdat");
    std::fs::write(&facts, b"the image's kernel facts").unwrap();
    let mounts = [
        (mark.path().to_str().unwrap(), PLUGINS),
        (preload.to_str().unwrap(), "/etc/ld.so.preload"),
        (config.path().to_str().unwrap(), "/etc/criu"),
    ];
    let spec = admitted(&with_host_paths(
        stateful_pod("marked-0", "marked", "0", &[("main", IMAGE, &COUNTER)]),
        &mounts,
    ));
    let pod = |kubelet: &Kubelet<'_>| {
        let (sandbox, mut main) = translate(kubelet, &spec);
        let host_path = loaded_by.path().display().to_string();
        main.mounts.push(Mount { container_path: MARK_OUT.into(), host_path, readonly: false });
        let host_path = run.path().display().to_string();
        main.mounts.push(Mount { container_path: "/run".into(), host_path, readonly: false });
        (sandbox, main)
    };

    let (sandbox, main) = pod(&kubelet);
    let first = kubelet.run(sandbox, main).await;
    registered(&d, &nri, &first);
    expect_within(TIMEOUT, "the pod to count", || (counted(&first).len() >= 3).then_some(()));
    // The image's preload is in force for the bundle's loader run in the container's root (as
    // stasisd once ran CRIU), with the container's own privileges.
    let bundle_loader = ["/.stasis/ld.so", "--library-path", "/.stasis/lib", "/.stasis/criu", "--version"];
    let (code, out, err) = kubelet.exec(&first, bundle_loader.map(String::from).to_vec(), 10).await;
    assert_eq!(code, 0, "{out}{err}");
    let marker = loaded_by.path().join("loaded-by");
    let loaded = loaders(&marker);
    assert!(loaded.iter().any(|l| !l.sys_admin), "the container's loader loads it: {loaded:?}");

    let (code, out, err) = kubelet.exec(&first, pre_stop(&spec), grace(&spec)).await;
    assert_eq!(code, 0, "preStop: {out}{err}\n{}", d.log_tail(40));
    let last = *counted(&first).last().unwrap();
    kubelet.delete(first, grace(&spec)).await;
    let (sandbox, main) = pod(&kubelet);
    let second = kubelet.run(sandbox, main).await;
    expect_within(TIMEOUT, "the restored pod to count", || (!counted(&second).is_empty()).then_some(()));
    assert_eq!(counted(&second)[0], last + 1, "restored\n{}", d.log_tail(40));
    kubelet.delete(second, grace(&spec)).await;

    let privileged = privileged_lines(&marker);
    assert!(privileged.is_empty(), "the image's code ran with the node's capabilities: {privileged:?}");
    let kept = std::fs::read(&facts).ok();
    assert_eq!(
        kept.as_deref(),
        Some(&b"the image's kernel facts"[..]),
        "CRIU used the image's /run/criu.kdat"
    );
    let left: Vec<_> = std::fs::read_dir(run.path()).unwrap().map(|e| e.unwrap().file_name()).collect();
    assert_eq!(left, ["criu.kdat"], "CRIU left files in the container's /run");
}

#[tokio::test(flavor = "multi_thread")]
async fn containers_reach_only_themselves_and_a_failed_eviction_stops_the_job_as_usual() {
    skip_unless_ready!();
    let Some(podman) = Podman::start() else { return };
    let Some(containerd) = Containerd::start(&podman) else { return };
    let endpoint = tempfile::tempdir().expect("endpoint directory");
    let disk_dir = tempfile::tempdir().expect("store directory");
    let disk = SmallDisk::mount(&disk_dir.path().join("store"), 64);
    let socket = endpoint.path().join("pod.sock").display().to_string();
    let store = format!("file://{}", disk_dir.path().join("store").display());
    let d = Daemon::start_with(&DaemonOptions {
        args: vec!["--pod-socket".into(), socket.clone()],
        store: Some(store),
        ..Default::default()
    });
    let nri = NriPlugin::start(&containerd, &d.socket(), &bundle(d.dir()), endpoint.path());
    let mut kubelet = Kubelet::new(&containerd).await;
    let trainer = admitted(&stateful_pod("trainer-0", "trainer", "0", &[("main", IMAGE, &COUNTER)]));
    // The other pod asks for a checkpoint every second, so its eviction has little to upload.
    let mut other = stateful_pod("other-0", "other", "0", &[("main", IMAGE, &COUNTER)]);
    other["metadata"]["annotations"] = serde_json::json!({ "stasis.dev/checkpoint-every": "1s" });
    let other = admitted(&other);
    let (sandbox, main) = translate(&kubelet, &trainer);
    let a = kubelet.run(sandbox, main).await;
    let (sandbox, main) = translate(&kubelet, &other);
    let b = kubelet.run(sandbox, main).await;
    registered(&d, &nri, &a);
    registered(&d, &nri, &b);
    expect_within(TIMEOUT, "both pods to count", || {
        (counted(&a).len() >= 3 && counted(&b).len() >= 3).then_some(())
    });

    let periodic =
        |d: &Daemon| d.json(&["list", "--workload", "k8s.test.statefulset.other.0.main", "--json"]);
    expect_within(TIMEOUT, "a periodic checkpoint of the other pod", || {
        periodic(&d)["checkpoints"].as_array().is_some_and(|c| !c.is_empty()).then_some(())
    });

    // A container sees the pod endpoint, not stasisd's API; its preStop hook evicts itself alone.
    let (code, out, _) =
        kubelet.exec(&b, vec!["/bin/sh".into(), "-c".into(), "echo /.stasis-run/*".into()], 10).await;
    assert_eq!((code, out.trim()), (0, "/.stasis-run/pod.sock"));
    let (code, out, err) = kubelet.exec(&b, pre_stop(&other), grace(&other)).await;
    assert_eq!(code, 0, "{out}{err}");
    let (a_then, b_then) = (counted(&a).len(), counted(&b).len());
    std::thread::sleep(std::time::Duration::from_millis(500));
    assert!(counted(&a).len() > a_then, "the other pod's eviction left this one running");
    assert_eq!(counted(&b).len(), b_then, "the evicted pod stopped");
    let checkpoints = periodic(&d)["checkpoints"].as_array().unwrap().clone();
    let eviction = checkpoints.last().unwrap();
    let (uploaded, total) =
        (eviction["stats"]["bytes_uploaded"].as_u64(), eviction["stats"]["bytes_total"].as_u64());
    assert!(checkpoints.len() >= 2, "periodic checkpoints, then the eviction: {checkpoints:?}");
    assert!(uploaded.unwrap() * 2 < total.unwrap(), "the eviction uploads what changed since: {eviction}");
    // A process in no container gets nothing.
    let mut stream = std::os::unix::net::UnixStream::connect(&socket).expect("the pod endpoint");
    writeln!(stream, r#"{{"op":"evict"}}"#).unwrap();
    let mut answer = String::new();
    std::io::BufReader::new(stream).read_line(&mut answer).unwrap();
    assert!(answer.contains("belongs to no registered container"), "{answer}");

    // Too little time left for the checkpoint: not tried, the job untouched.
    let mut hurried = pre_stop(&trainer);
    hurried.extend(["--grace-seconds".to_owned(), "5".to_owned()]);
    let (code, out, err) = kubelet.exec(&a, hurried, 10).await;
    assert_eq!(code, 1, "{out}{err}");
    assert!(err.contains("cannot be made durable in the time left"), "{err}");
    let counting = counted(&a).len();
    expect_within(TIMEOUT, "the job to run on", || (counted(&a).len() > counting + 2).then_some(()));

    // The store fails: the preStop hook says so, the job runs on, and stops as it would have.
    disk.read_only();
    let (code, out, err) = kubelet.exec(&a, pre_stop(&trainer), grace(&trainer)).await;
    assert_eq!(code, 1, "{out}{err}");
    assert!(err.contains("no checkpoint") && err.contains("left running"), "{err}");
    let counting = counted(&a).len();
    expect_within(TIMEOUT, "the job to run on", || (counted(&a).len() > counting + 2).then_some(()));
    let started = std::time::Instant::now();
    let exit = kubelet.delete(a, grace(&trainer)).await;
    assert_eq!(exit, 128 + 15, "SIGTERM reached the job");
    assert!(
        started.elapsed() < std::time::Duration::from_secs(10),
        "stopped at once, not at the grace period's end"
    );
    let listed = d.json(&["list", "--workload", "k8s.test.statefulset.trainer.0.main", "--json"]);
    assert_eq!(listed["checkpoints"].as_array().map(Vec::len), Some(0), "{listed}");
    kubelet.delete(b, grace(&other)).await;
}

#[tokio::test(flavor = "multi_thread")]
async fn the_nri_plugin_survives_a_containerd_restart_and_synchronizes_again() {
    skip_unless_ready!();
    let Some(podman) = Podman::start() else { return };
    let Some(mut containerd) = Containerd::start(&podman) else { return };
    let endpoint = tempfile::tempdir().expect("endpoint directory");
    let d = daemon(endpoint.path());
    let nri = NriPlugin::start(&containerd, &d.socket(), &bundle(d.dir()), endpoint.path());
    let first = admitted(&stateful_pod("trainer-0", "trainer", "0", &[("main", IMAGE, &COUNTER)]));
    let a = {
        let mut kubelet = Kubelet::new(&containerd).await;
        let (sandbox, main) = translate(&kubelet, &first);
        kubelet.run(sandbox, main).await
    };
    registered(&d, &nri, &a);
    expect_within(TIMEOUT, "the pod to count", || (counted(&a).len() >= 3).then_some(()));

    // stasisd forgets the container; containerd restarts (its containers run on).
    d.ok(&["container", "forget", &a.container]);
    let registrations = |nri: &NriPlugin| nri.log_text().matches("registered with the runtime").count();
    containerd.restart();
    expect_within(TIMEOUT, "stasis-nri to register again", || (registrations(&nri) >= 2).then_some(()));
    // Synchronization tells stasisd of the running container again; a new pod is prepared.
    registered(&d, &nri, &a);
    let mut kubelet = Kubelet::new(&containerd).await;
    let second = admitted(&stateful_pod("other-0", "other", "0", &[("main", IMAGE, &COUNTER)]));
    let (sandbox, main) = translate(&kubelet, &second);
    let b = kubelet.run(sandbox, main).await;
    registered(&d, &nri, &b);
    expect_within(TIMEOUT, "the new pod to count", || (counted(&b).len() >= 3).then_some(()));
    kubelet.delete(a, grace(&first)).await;
    kubelet.delete(b, grace(&second)).await;
}

#[tokio::test(flavor = "multi_thread")]
async fn an_evicted_numpy_training_loop_goes_on_with_the_losses_of_an_uninterrupted_run() {
    skip_unless_ready!();
    let Some(podman) = Podman::start() else { return };
    let Some(containerd) = Containerd::start(&podman) else { return };
    let python = stasis_tests::venv_python("numpy");
    let script = stasis_tests::workload_script("train_numpy.py");
    let reference = std::process::Command::new(&python)
        .args([&script, "--steps", "120", "--pause", "0"])
        .output()
        .unwrap();
    let reference: Vec<String> =
        String::from_utf8_lossy(&reference.stdout).lines().map(str::to_owned).collect();
    assert_eq!(reference.len(), 120);
    let endpoint = tempfile::tempdir().expect("endpoint directory");
    let d = daemon(endpoint.path());
    let nri = NriPlugin::start(&containerd, &d.socket(), &bundle(d.dir()), endpoint.path());
    let mut kubelet = Kubelet::new(&containerd).await;
    let paths = python_paths(&python);
    let paths: Vec<(&str, &str)> = paths.iter().map(|(h, i)| (h.as_str(), i.as_str())).collect();
    let train = [python.as_str(), script.as_str()];
    let spec = admitted(&with_host_paths(
        stateful_pod("trainer-0", "trainer", "0", &[("main", IMAGE, &train)]),
        &paths,
    ));
    let steps = |pod: &RunningPod| -> Vec<String> {
        stdout_lines(&pod.log).into_iter().filter(|l| l.starts_with("step ")).collect()
    };

    let (sandbox, main) = translate(&kubelet, &spec);
    let first = kubelet.run(sandbox, main).await;
    registered(&d, &nri, &first);
    expect_within(TIMEOUT, "the loop to take 30 steps", || (steps(&first).len() >= 30).then_some(()));
    let (code, out, err) = kubelet.exec(&first, pre_stop(&spec), grace(&spec)).await;
    assert_eq!(code, 0, "preStop: {out}{err}\n{}", d.log_tail(40));
    let before = steps(&first);
    kubelet.delete(first, grace(&spec)).await;

    let (sandbox, main) = translate(&kubelet, &spec);
    let second = kubelet.run(sandbox, main).await;
    let went_on = wait_for(TIMEOUT, || (steps(&second).len() >= 30).then_some(()));
    let logged = std::fs::read_to_string(&second.log).unwrap_or_default();
    assert!(went_on.is_some(), "the restored loop took no 30 steps:\n{logged}\n{}", d.log_tail(40));
    let after = steps(&second);
    let all: Vec<String> = before.iter().chain(&after).cloned().collect();
    let n = all.len().min(reference.len());
    assert_eq!(
        all[..n],
        reference[..n],
        "the losses of the evicted and restored loop, step by step\n{}",
        d.log_tail(30)
    );
    assert!(
        after[0].starts_with(&format!("step {} ", before.len() + 1)),
        "{} then {}",
        before.len(),
        after[0]
    );
    kubelet.delete(second, grace(&spec)).await;
}
