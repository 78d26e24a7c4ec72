//! A kubelet's part, for the Kubernetes tests: Pod objects admitted by stasis' webhook (its
//! JSONPatch applied), translated for the runtime and run through containerd's CRI
//! (tests/src/containerd.rs) as a kubelet runs them; and stasis-nri registered with the
//! runtime's NRI.

use std::collections::HashMap;
use std::path::{Path, PathBuf};

use stasis_proto::cri::runtime_service_client::RuntimeServiceClient;
use stasis_proto::cri::{
    ContainerConfig, ContainerMetadata, ContainerStatusRequest, CreateContainerRequest, ExecSyncRequest,
    ImageSpec, KeyValue, LinuxContainerConfig, LinuxContainerSecurityContext, LinuxPodSandboxConfig,
    LinuxSandboxSecurityContext, Mount, NamespaceMode, NamespaceOption, PodSandboxConfig, PodSandboxMetadata,
    RemovePodSandboxRequest, RunPodSandboxRequest, StartContainerRequest, StopContainerRequest,
    StopPodSandboxRequest,
};
use stasis_proto::tonic::transport::Channel;

use crate::containerd::Containerd;

/// The namespaces of a pod on the host's network (no CNI here) whose containers have a pid
/// namespace each, the kubelet's default (no shareProcessNamespace); the kubelet gives them
/// to the pod and to each container.
fn namespaces() -> NamespaceOption {
    NamespaceOption {
        network: NamespaceMode::Node as i32,
        pid: NamespaceMode::Container as i32,
        ..Default::default()
    }
}

/// A pod on the host's network, logging under `logs`.
pub fn pod(name: &str, logs: &Path) -> PodSandboxConfig {
    let host = namespaces();
    PodSandboxConfig {
        metadata: Some(PodSandboxMetadata {
            name: name.into(),
            uid: format!("uid-{name}"),
            namespace: "test".into(),
            attempt: 0,
        }),
        log_directory: logs.display().to_string(),
        linux: Some(LinuxPodSandboxConfig {
            security_context: Some(LinuxSandboxSecurityContext { namespace_options: Some(host) }),
            ..Default::default()
        }),
        labels: HashMap::from([("stasis.dev/test".into(), name.into())]),
        ..Default::default()
    }
}

/// A container running `command` with `image`, logging to `<name>.log`.
pub fn container(name: &str, image: &str, command: &[&str]) -> ContainerConfig {
    ContainerConfig {
        metadata: Some(ContainerMetadata { name: name.into(), attempt: 0 }),
        image: Some(ImageSpec { image: image.into(), ..Default::default() }),
        command: command.iter().map(|s| s.to_string()).collect(),
        log_path: format!("{name}.log"),
        linux: Some(LinuxContainerConfig {
            security_context: Some(LinuxContainerSecurityContext { namespace_options: Some(namespaces()) }),
        }),
        ..Default::default()
    }
}

/// A Pod object: `containers` (name, image, command) in pod `name` of namespace `test`,
/// owned by StatefulSet `owner` as its pod `ordinal`, opted in to stasis.
pub fn stateful_pod(
    name: &str,
    owner: &str,
    ordinal: &str,
    containers: &[(&str, &str, &[&str])],
) -> serde_json::Value {
    let containers: Vec<serde_json::Value> = containers
        .iter()
        .map(|(name, image, command)| serde_json::json!({ "name": name, "image": image, "command": command }))
        .collect();
    serde_json::json!({
        "apiVersion": "v1",
        "kind": "Pod",
        "metadata": {
            "name": name,
            "namespace": "test",
            "labels": { "stasis.dev/checkpoint": "true", "apps.kubernetes.io/pod-index": ordinal },
            "ownerReferences": [{ "apiVersion": "apps/v1", "kind": "StatefulSet", "name": owner, "uid": "u", "controller": true }],
        },
        "spec": { "containers": containers },
    })
}

/// `pod` with host directories mounted read-only into its first container (hostPath
/// volumes): (host path, path inside).
pub fn with_host_paths(mut pod: serde_json::Value, paths: &[(&str, &str)]) -> serde_json::Value {
    let volumes: Vec<serde_json::Value> = paths
        .iter()
        .enumerate()
        .map(
            |(i, (host, _))| serde_json::json!({ "name": format!("host-{i}"), "hostPath": { "path": host } }),
        )
        .collect();
    let mounts: Vec<serde_json::Value> = paths
        .iter()
        .enumerate()
        .map(|(i, (_, inside))| serde_json::json!({ "name": format!("host-{i}"), "mountPath": inside, "readOnly": true }))
        .collect();
    pod["spec"]["volumes"] = serde_json::Value::Array(volumes);
    pod["spec"]["containers"][0]["volumeMounts"] = serde_json::Value::Array(mounts);
    pod
}

/// The host directories a container needs to run the virtual environment's Python: /usr (also
/// as /lib and /lib64, the loader's paths), the Python installation the environment was made
/// from, the environment, and the test workloads.
pub fn python_paths(python: &str) -> Vec<(String, String)> {
    let venv = Path::new(python).parent().and_then(Path::parent).expect("a venv's python").to_path_buf();
    let config = std::fs::read_to_string(venv.join("pyvenv.cfg")).unwrap_or_default();
    let home =
        config.lines().find_map(|l| l.strip_prefix("home = ")).map(|h| Path::new(h.trim()).to_path_buf());
    let prefix = home.and_then(|h| h.parent().map(Path::to_path_buf)).expect("the venv's base Python");
    let workloads =
        Path::new(env!("CARGO_MANIFEST_DIR")).join("workloads").canonicalize().expect("the test workloads");
    let mut paths = vec![
        ("/usr".to_owned(), "/usr".to_owned()),
        ("/usr/lib".to_owned(), "/lib".to_owned()),
        ("/usr/lib64".to_owned(), "/lib64".to_owned()),
    ];
    for dir in [prefix, venv, workloads] {
        if !dir.starts_with("/usr") {
            paths.push((dir.display().to_string(), dir.display().to_string()));
        }
    }
    paths
}

/// A pod as the kubelet gets it from the API server: admitted by stasis' webhook (its
/// AdmissionReview answered and the answer's JSONPatch applied).
pub fn admitted(pod: &serde_json::Value) -> serde_json::Value {
    use base64::Engine as _;
    let review = serde_json::json!({
        "apiVersion": "admission.k8s.io/v1",
        "kind": "AdmissionReview",
        "request": { "uid": "test", "kind": { "kind": "Pod" }, "operation": "CREATE", "object": pod },
    });
    let sizing = stasis_webhook::mutate::Sizing {
        store_bytes_per_sec: 200_000_000,
        gpu_memory_bytes: 80 << 30,
        margin_secs: 30,
    };
    let answer =
        stasis_webhook::review::answer(review.to_string().as_bytes(), &sizing).expect("the webhook's answer");
    let response = &answer["response"];
    assert_eq!(response["allowed"], true, "the webhook refused: {response}");
    let mut pod = pod.clone();
    if let Some(patch) = response["patch"].as_str() {
        let patch = base64::engine::general_purpose::STANDARD.decode(patch).expect("base64");
        let patch: json_patch::Patch = serde_json::from_slice(&patch).expect("a JSONPatch");
        json_patch::patch(&mut pod, &patch).expect("the patch applies");
    }
    pod
}

/// What the kubelet makes of admitted pod `pod` for the runtime: the sandbox's configuration
/// (labels and annotations from the pod's) and its first container's.
pub fn translate(kubelet: &Kubelet<'_>, pod: &serde_json::Value) -> (PodSandboxConfig, ContainerConfig) {
    let text = |v: &serde_json::Value| v.as_str().unwrap_or_default().to_owned();
    let map = |v: &serde_json::Value| -> HashMap<String, String> {
        v.as_object().into_iter().flatten().map(|(k, v)| (k.clone(), text(v))).collect()
    };
    let mut sandbox = kubelet.pod(&text(&pod["metadata"]["name"]));
    sandbox.labels.extend(map(&pod["metadata"]["labels"]));
    sandbox.annotations.extend(map(&pod["metadata"]["annotations"]));
    let c = &pod["spec"]["containers"][0];
    let command: Vec<String> = c["command"].as_array().into_iter().flatten().map(text).collect();
    let command: Vec<&str> = command.iter().map(String::as_str).collect();
    let mut config = container(&text(&c["name"]), &text(&c["image"]), &command);
    config.envs = c["env"]
        .as_array()
        .into_iter()
        .flatten()
        .map(|e| KeyValue { key: text(&e["name"]), value: text(&e["value"]) })
        .collect();
    // hostPath volumes, as the kubelet mounts them.
    let volumes = pod["spec"]["volumes"].as_array().cloned().unwrap_or_default();
    for mount in c["volumeMounts"].as_array().into_iter().flatten() {
        let volume = volumes.iter().find(|v| v["name"] == mount["name"]).expect("a volume of that name");
        config.mounts.push(Mount {
            container_path: text(&mount["mountPath"]),
            host_path: text(&volume["hostPath"]["path"]),
            readonly: mount["readOnly"] == true,
        });
    }
    (sandbox, config)
}

/// The preStop hook of admitted pod `pod`'s first container.
pub fn pre_stop(pod: &serde_json::Value) -> Vec<String> {
    let hook = &pod["spec"]["containers"][0]["lifecycle"]["preStop"]["exec"]["command"];
    hook.as_array()
        .expect("a preStop hook")
        .iter()
        .map(|s| s.as_str().unwrap_or_default().to_owned())
        .collect()
}

/// The startup probe of admitted pod `pod`'s first container.
pub fn startup_probe(pod: &serde_json::Value) -> Vec<String> {
    let probe = &pod["spec"]["containers"][0]["startupProbe"]["exec"]["command"];
    probe
        .as_array()
        .expect("a startup probe")
        .iter()
        .map(|s| s.as_str().unwrap_or_default().to_owned())
        .collect()
}

/// The grace period of admitted pod `pod`.
pub fn grace(pod: &serde_json::Value) -> i64 {
    pod["spec"]["terminationGracePeriodSeconds"].as_i64().unwrap_or(30)
}

/// The pod bundle in `dir`: scripts/pod-bundle.sh's (CRIU and its libraries) and this build's
/// stasis-pod and libstasis_enter_root.so.
pub fn bundle(dir: &Path) -> PathBuf {
    let made = Path::new(env!("CARGO_MANIFEST_DIR")).join("../.stasis/pod-bundle");
    let out = std::process::Command::new("cp").arg("-a").arg(&made).arg(dir).output().expect("cp");
    assert!(
        out.status.success(),
        "copying {} (scripts/pod-bundle.sh): {}",
        made.display(),
        String::from_utf8_lossy(&out.stderr)
    );
    let bundle = dir.join("pod-bundle");
    for file in ["stasis-pod", "libstasis_enter_root.so"] {
        std::fs::copy(crate::bin(file), bundle.join(file)).expect("this build's programs into the bundle");
    }
    bundle
}

/// A kubelet: a CRI client of `containerd`.
pub struct Kubelet<'a> {
    pub containerd: &'a Containerd,
    pub cri: RuntimeServiceClient<Channel>,
    pub logs: PathBuf,
    /// Pods made so far.
    made: std::sync::atomic::AtomicU32,
}

/// A running pod and its one container.
pub struct RunningPod {
    pub sandbox: String,
    pub container: String,
    /// The container's log (the CRI's format: `<time> stdout F <text>`).
    pub log: PathBuf,
}

impl<'a> Kubelet<'a> {
    pub async fn new(containerd: &'a Containerd) -> Kubelet<'a> {
        let logs = containerd.dir().join("pods");
        std::fs::create_dir_all(&logs).expect("pod logs");
        Kubelet { cri: containerd.cri().await, containerd, logs, made: Default::default() }
    }

    /// Pod `name`'s configuration, logging under this kubelet's directory.
    /// Each pod made gets a UID of its own, as the API server gives it, and the kubelet's log
    /// directory of that UID (a pod made again under its name has a new one).
    pub fn pod(&self, name: &str) -> PodSandboxConfig {
        let uid = format!("{name}-{}", self.made.fetch_add(1, std::sync::atomic::Ordering::Relaxed));
        let logs = self.logs.join(&uid);
        std::fs::create_dir_all(&logs).expect("pod log directory");
        let mut config = pod(name, &logs);
        config.metadata.iter_mut().for_each(|m| m.uid = uid.clone());
        config
    }

    /// Runs pod `config` with `container` in it, started.
    pub async fn run(&mut self, config: PodSandboxConfig, container: ContainerConfig) -> RunningPod {
        let name = config.metadata.as_ref().map(|m| m.name.clone()).unwrap_or_default();
        let log = PathBuf::from(&config.log_directory).join(&container.log_path);
        let request = RunPodSandboxRequest { config: Some(config.clone()), runtime_handler: String::new() };
        let sandbox = self.cri.run_pod_sandbox(request).await;
        let sandbox =
            sandbox.unwrap_or_else(|e| panic!("RunPodSandbox {name}: {e}\n{}", self.containerd.log_tail()));
        let sandbox = sandbox.into_inner().pod_sandbox_id;
        let request = CreateContainerRequest {
            pod_sandbox_id: sandbox.clone(),
            config: Some(container),
            sandbox_config: Some(config),
        };
        let created = self.cri.create_container(request).await;
        let id = created.unwrap_or_else(|e| panic!("CreateContainer: {e}\n{}", self.containerd.log_tail()));
        let id = id.into_inner().container_id;
        self.cri
            .start_container(StartContainerRequest { container_id: id.clone() })
            .await
            .expect("StartContainer");
        RunningPod { sandbox, container: id, log }
    }

    /// The host pid of the container's init (from containerd's verbose status).
    pub async fn init_pid(&mut self, pod: &RunningPod) -> i32 {
        let request = ContainerStatusRequest { container_id: pod.container.clone(), verbose: true };
        let status = self.cri.container_status(request).await.expect("ContainerStatus").into_inner();
        let info: serde_json::Value = serde_json::from_str(&status.info["info"]).expect("containerd's info");
        info["pid"].as_i64().expect("the container's pid") as i32
    }

    /// Runs `cmd` in the pod's container, as a preStop hook runs: exit code, stdout, stderr.
    pub async fn exec(&mut self, pod: &RunningPod, cmd: Vec<String>, timeout: i64) -> (i32, String, String) {
        let request = ExecSyncRequest { container_id: pod.container.clone(), cmd, timeout };
        let out = self.cri.exec_sync(request).await.expect("ExecSync").into_inner();
        let text = |b: &[u8]| String::from_utf8_lossy(b).into_owned();
        (out.exit_code, text(&out.stdout), text(&out.stderr))
    }

    /// Stops the container (SIGTERM, `grace` seconds, SIGKILL) and removes the pod; returns the
    /// container's exit code.
    pub async fn delete(&mut self, pod: RunningPod, grace: i64) -> i32 {
        let request = StopContainerRequest { container_id: pod.container.clone(), timeout: grace };
        self.cri.stop_container(request).await.expect("StopContainer");
        let request = ContainerStatusRequest { container_id: pod.container.clone(), verbose: false };
        let status = self.cri.container_status(request).await.expect("ContainerStatus").into_inner();
        let sandbox = pod.sandbox;
        self.cri
            .stop_pod_sandbox(StopPodSandboxRequest { pod_sandbox_id: sandbox.clone() })
            .await
            .expect("StopPodSandbox");
        let removed = self.cri.remove_pod_sandbox(RemovePodSandboxRequest { pod_sandbox_id: sandbox }).await;
        removed.expect("RemovePodSandbox");
        status.status.map(|s| s.exit_code).unwrap_or(-1)
    }
}

/// The lines the container wrote to stdout, from its CRI log.
pub fn stdout_lines(log: &Path) -> Vec<String> {
    let text = std::fs::read_to_string(log).unwrap_or_default();
    text.lines().filter_map(|l| l.split_once(" stdout F ").map(|(_, t)| t.to_owned())).collect()
}

/// stasis-nri, registered with `containerd`'s NRI and telling stasisd at `stasis_socket`.
pub struct NriPlugin {
    child: std::process::Child,
    pub log: PathBuf,
}

impl NriPlugin {
    pub fn start(
        containerd: &Containerd,
        stasis_socket: &Path,
        bundle: &Path,
        endpoint_dir: &Path,
    ) -> NriPlugin {
        let log = containerd.dir().join("stasis-nri.log");
        let file = std::fs::File::create(&log).expect("plugin log");
        let child = std::process::Command::new(crate::bin("stasis-nri"))
            .arg("--nri-socket")
            .arg(containerd.nri_socket())
            .arg("--stasis-socket")
            .arg(stasis_socket)
            .arg("--bundle")
            .arg(bundle)
            .arg("--endpoint-dir")
            .arg(endpoint_dir)
            .arg("--cri-socket")
            .arg(containerd.socket())
            .env("NO_COLOR", "1")
            .stdout(file.try_clone().expect("log"))
            .stderr(file)
            .spawn()
            .expect("starting stasis-nri");
        let plugin = NriPlugin { child, log };
        crate::expect_within(crate::TIMEOUT, "stasis-nri to register with containerd", || {
            plugin.log_text().contains("registered with the runtime").then_some(())
        });
        plugin
    }

    pub fn log_text(&self) -> String {
        std::fs::read_to_string(&self.log).unwrap_or_default()
    }
}

impl Drop for NriPlugin {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}
