//! A CUDA job in a Kubernetes container, on the fake driver (tests/fake-cuda, built as
//! libcuda.so.1; no GPU here): its pod is evicted through its preStop hook and restored into
//! the pod that replaces it, the CUDA phase made inside each container (the calls' pid and
//! mount namespaces are the container's, their pids the container's numbering), and a pod not
//! given the GPU the checkpoint's job had is refused the restore. Run through containerd's CRI
//! and NRI as tests/tests/kubernetes.rs runs pods, the GPU given as a device plugin's
//! allocation reaches the runtime: a device of the container. The pods' image preloads a
//! library into everything its loader starts: nothing stasisd runs as root in the containers
//! (CRIU, the CUDA helper) may load it, and the helper may start no program there.

#![forbid(unsafe_code)]

use std::path::Path;

use stasis_proto::cri::{ContainerConfig, Device, Mount};
use stasis_tests::containerd::Containerd;
use stasis_tests::kube::{
    Kubelet, NriPlugin, RunningPod, admitted, bundle, grace, pre_stop, python_paths, stateful_pod,
    stdout_lines, translate, with_host_paths,
};
use stasis_tests::podman::{IMAGE, Podman};
use stasis_tests::preload::{loaders, marker_library, privileged_lines};
use stasis_tests::{Daemon, DaemonOptions, TIMEOUT, expect_within, procfs, skip_unless_ready, wait_for};

/// Where the containers find the fake driver library, and (`states` beside it, writable) its
/// states and its log of calls, which stasisd's helper finds beside the node's copy.
const FAKE_LIBRARY: &str = "/opt/fake-cuda";

/// Where the pods find the library their image preloads, and where it writes who loaded it.
const MARK: &str = "/opt/mark";
const MARK_OUT: &str = "/opt/mark-out";

/// The numbers the pod's job wrote.
fn counted(pod: &RunningPod) -> Vec<u64> {
    stdout_lines(&pod.log).iter().filter_map(|l| l.trim().parse().ok()).collect()
}

/// Where a call was made: its caller's pid and mount namespaces and root directory.
type Place = (u64, u64, String);

/// The checkpoint calls the fake driver logged: (call, pid, where it was made).
fn calls(states: &Path) -> Vec<(String, i32, Place)> {
    let log = std::fs::read_to_string(states.join("calls")).unwrap_or_default();
    let field = |word: &str, key: &str| word.strip_prefix(key).and_then(|v| v.parse().ok()).unwrap_or(0);
    log.lines()
        .filter_map(|line| {
            let words: Vec<&str> = line.split(' ').collect();
            let (call, pid) = (words.first()?.to_string(), words.get(1)?.parse().ok()?);
            let root = words.get(4)?.strip_prefix("root=")?.to_owned();
            Some((call, pid, (field(words.get(2)?, "pidns="), field(words.get(3)?, "mntns="), root)))
        })
        .filter(|(call, ..)| call != "restore-thread")
        .collect()
}

/// Where container init `init`'s processes are: its namespaces and its root directory.
fn place_of(init: i32) -> Place {
    use std::os::unix::fs::MetadataExt;
    let root = std::fs::metadata(format!("/proc/{init}/root")).expect("the container's root");
    (namespace(init, "pid"), namespace(init, "mnt"), format!("{}:{}", root.dev(), root.ino()))
}

/// The inode of namespace `kind` of process `pid`.
fn namespace(pid: i32, kind: &str) -> u64 {
    let link = std::fs::read_link(format!("/proc/{pid}/ns/{kind}")).expect("a namespace link");
    let text = link.to_string_lossy().into_owned();
    text.split_once('[')
        .and_then(|(_, r)| r.strip_suffix(']'))
        .and_then(|n| n.parse().ok())
        .expect("an inode")
}

/// The pod's job: the one child of its container's init, as (host pid, pid inside).
async fn job(kubelet: &mut Kubelet<'_>, pod: &RunningPod) -> (i32, i32, i32) {
    let init = kubelet.init_pid(pod).await;
    let host = expect_within(TIMEOUT, "the container's job", || procfs::children(init).first().copied());
    let inner = *procfs::ns_pids(host).last().expect("the job's pids");
    (init, host, inner)
}

/// `config` given the GPU device file `gpu` (when some) and the fake driver's states.
fn with_gpu(mut config: ContainerConfig, gpu: Option<&Path>, states: &Path) -> ContainerConfig {
    config.mounts.push(Mount {
        container_path: format!("{FAKE_LIBRARY}/states"),
        host_path: states.display().to_string(),
        readonly: false,
    });
    config.devices.extend(gpu.map(|gpu| Device {
        container_path: "/dev/nvidia0".into(),
        host_path: gpu.display().to_string(),
        permissions: "rw".into(),
    }));
    config
}

#[tokio::test(flavor = "multi_thread")]
async fn a_cuda_job_in_a_container_is_evicted_and_restored_through_the_driver_inside_it() {
    skip_unless_ready!();
    let Some(podman) = Podman::start() else { return };
    let Some(containerd) = Containerd::start(&podman) else { return };
    // The fake driver as libcuda.so.1, a GPU device file for the pods (NVIDIA's major; nothing
    // opens it), and the directory of the driver's states beside it, which the containers
    // share.
    let fake = tempfile::tempdir().expect("a directory for the fake driver");
    let library = fake.path().join("lib");
    std::fs::create_dir(&library).unwrap();
    std::fs::copy(stasis_tests::bin("libstasis_fake_cuda.so"), library.join("libcuda.so.1")).unwrap();
    let gpu = fake.path().join("nvidia0");
    let device = nix::sys::stat::makedev(195, 0);
    nix::sys::stat::mknod(
        &gpu,
        nix::sys::stat::SFlag::S_IFCHR,
        nix::sys::stat::Mode::from_bits_truncate(0o666),
        device,
    )
    .expect("mknod of the GPU device file");
    let states = library.join("states");
    std::fs::create_dir(&states).unwrap();
    // The driver, initialised in a container's root, starts a program there (as the real one
    // starts nvidia-modprobe): one the image's loader runs, with its preloaded library.
    std::fs::write(states.join("init-runs"), "/usr/bin/true").unwrap();

    let endpoint = tempfile::tempdir().expect("endpoint directory");
    let socket = endpoint.path().join("pod.sock").display().to_string();
    let d = Daemon::start_with(&DaemonOptions {
        args: vec!["--pod-socket".into(), socket],
        env: vec![("LD_LIBRARY_PATH".into(), library.display().to_string())],
        ..Default::default()
    });
    assert!(
        d.log_tail(40).contains("CUDA driver loaded"),
        "stasisd loads the fake driver:\n{}",
        d.log_tail(40)
    );
    let nri = NriPlugin::start(&containerd, &d.socket(), &bundle(d.dir()), endpoint.path());
    let mut kubelet = Kubelet::new(&containerd).await;
    let python = stasis_tests::venv_python("ctypes");
    let script = stasis_tests::workload_script("cuda_counter.py");
    let driver = format!("{FAKE_LIBRARY}/libcuda.so.1");
    // The image preloads a library into every program its loader starts (its
    // /etc/ld.so.preload): the job loads it, nothing stasisd runs as root may.
    let mark = tempfile::tempdir().expect("a directory for the preloaded library");
    let loaded_by = tempfile::tempdir().expect("a directory for the library's marker");
    let library_inside = format!("{MARK}/mark.so");
    marker_library(mark.path(), &Path::new(MARK_OUT).join("loaded-by"));
    std::fs::write(mark.path().join("ld.so.preload"), format!("{library_inside}\n")).unwrap();
    let mut paths = python_paths(&python);
    paths.push((library.display().to_string(), FAKE_LIBRARY.to_owned()));
    paths.push((mark.path().display().to_string(), MARK.to_owned()));
    paths.push((mark.path().join("ld.so.preload").display().to_string(), "/etc/ld.so.preload".to_owned()));
    let paths: Vec<(&str, &str)> = paths.iter().map(|(h, i)| (h.as_str(), i.as_str())).collect();
    let job_command = [python.as_str(), script.as_str(), driver.as_str()];
    let spec = admitted(&with_host_paths(
        stateful_pod("cuda-0", "cudajob", "0", &[("main", IMAGE, &job_command)]),
        &paths,
    ));
    let pod = |kubelet: &Kubelet<'_>, gpu: Option<&Path>| {
        let (sandbox, mut main) = translate(kubelet, &spec);
        main.mounts.push(Mount {
            container_path: MARK_OUT.into(),
            host_path: loaded_by.path().display().to_string(),
            readonly: false,
        });
        (sandbox, with_gpu(main, gpu, &states))
    };

    let (sandbox, main) = pod(&kubelet, Some(&gpu));
    let first = kubelet.run(sandbox, main).await;
    expect_within(TIMEOUT, "the job to count to 10", || (counted(&first).len() >= 10).then_some(()));
    let (init, _, inner) = job(&mut kubelet, &first).await;
    let (code, out, err) = kubelet.exec(&first, pre_stop(&spec), grace(&spec)).await;
    assert_eq!(code, 0, "preStop: {out}{err}\n{}\n{}", d.log_tail(40), nri.log_text());
    let inside_first = place_of(init);
    let last = *counted(&first).last().unwrap();
    let dumped = calls(&states);
    let names: Vec<&str> = dumped.iter().map(|(c, ..)| c.as_str()).collect();
    assert_eq!(names, ["lock", "checkpoint"], "the eviction's CUDA calls: {dumped:?}");
    for (call, pid, place) in &dumped {
        assert_eq!(*pid, inner, "{call} names the job as its container numbers it");
        assert_eq!(*place, inside_first, "{call} was made inside the container, in its root");
    }
    assert_ne!(inside_first.0, namespace(std::process::id() as i32, "pid"));
    kubelet.delete(first, grace(&spec)).await;

    // A pod given no GPU cannot take the job: its init is told why, the checkpoint stays.
    let (sandbox, main) = pod(&kubelet, None);
    let bare = kubelet.run(sandbox, main).await;
    let said = expect_within(TIMEOUT, "the GPU-less pod to be refused", || {
        let log = std::fs::read_to_string(&bare.log).unwrap_or_default();
        log.contains("GPU").then_some(log)
    });
    assert!(said.contains("used 1 GPU(s)") && said.contains("was given 0"), "{said}");
    assert!(counted(&bare).is_empty(), "nothing ran in it: {said}");
    kubelet.delete(bare, grace(&spec)).await;

    // One given a GPU takes it: the job counts on from where it was evicted, its CUDA state
    // put back and unlocked inside the new container.
    let (sandbox, main) = pod(&kubelet, Some(&gpu));
    let second = kubelet.run(sandbox, main).await;
    let counts = wait_for(TIMEOUT, || (!counted(&second).is_empty()).then_some(()));
    let log = std::fs::read_to_string(&second.log).unwrap_or_default();
    assert!(
        counts.is_some(),
        "the restored job does not count: {log}\n{:?}\n{}",
        calls(&states),
        d.log_tail(30)
    );
    let (init, _, restored_inner) = job(&mut kubelet, &second).await;
    assert_eq!(restored_inner, inner, "the job keeps its pid inside the container");
    assert_eq!(counted(&second)[0], last + 1, "the job went on from where it stopped\n{}", d.log_tail(30));
    let inside_second = place_of(init);
    let restored = calls(&states).split_off(dumped.len());
    let names: Vec<&str> = restored.iter().map(|(c, ..)| c.as_str()).collect();
    assert_eq!(names, ["restore", "unlock"], "the restore's CUDA calls: {restored:?}");
    for (call, pid, place) in &restored {
        assert_eq!(*pid, inner, "{call} names the job as its container numbers it");
        assert_eq!(*place, inside_second, "{call} was made inside the new container, in its root");
    }
    kubelet.delete(second, grace(&spec)).await;

    // The job loaded the image's preloaded library (so the image's loader configuration was in
    // force in the container), and nothing with the node's capabilities did: not CRIU, not the
    // CUDA helper.
    let loaded = loaders(&loaded_by.path().join("loaded-by"));
    assert!(loaded.iter().any(|l| !l.sys_admin && l.exe.contains("python")), "the job loads it: {loaded:?}");
    let privileged = privileged_lines(&loaded_by.path().join("loaded-by"));
    assert!(privileged.is_empty(), "the image's preload ran with the node's capabilities: {privileged:?}");
    let started = std::fs::read_to_string(states.join("init-ran")).unwrap_or_default();
    assert!(
        !started.is_empty() && started.lines().all(|l| l.starts_with("refused") && l.contains("os error 1")),
        "the CUDA helper may start no program in the container: {started:?}"
    );
}

/// The GPU device check's container section (tests/gpu/container_test.sh: a container made
/// with unshare, no runtime) passes on the fake driver, so that it is known to work before a
/// GPU machine runs it with the memtest.
#[test]
fn the_device_check_s_container_script_passes_on_the_fake_driver() {
    skip_unless_ready!();
    let dir = tempfile::tempdir().expect("a directory for the pod bundle");
    let root = Path::new(env!("CARGO_MANIFEST_DIR")).join("..");
    let out = std::process::Command::new("bash")
        .arg("tests/gpu/container_test.sh")
        .current_dir(&root)
        .env("FAKE_CUDA", stasis_tests::bin("libstasis_fake_cuda.so"))
        .env("STASISD", stasis_tests::bin("stasisd"))
        .env("STASIS", stasis_tests::bin("stasis"))
        .env("POD_BUNDLE", bundle(dir.path()))
        .env("CRIU", stasis_tests::criu_path())
        .output()
        .expect("running container_test.sh");
    let text = format!("{}{}", String::from_utf8_lossy(&out.stdout), String::from_utf8_lossy(&out.stderr));
    assert!(out.status.success() && text.contains("PASS:"), "container_test.sh:\n{text}");
}
