//! Which containers are stasis', who they are, and what they get injected.
//!
//! A pod opts in with the label `stasis.dev/checkpoint: "true"`. stasis' webhook records the
//! pod's owner in annotations (`stasis.dev/owner-kind`, `stasis.dev/owner-name`,
//! `stasis.dev/ordinal`), since the runtime knows nothing of owners; a bare pod is its own
//! owner. The image comes from the runtime's annotation.

use std::path::PathBuf;

use stasis_proto::nri::{Container, ContainerAdjustment, KeyValue, LinuxDevice, Mount, PodSandbox};
use stasis_proto::stasis::v1::RegisterContainerRequest;

pub const OPT_IN: &str = "stasis.dev/checkpoint";
pub const OWNER_KIND: &str = "stasis.dev/owner-kind";
pub const OWNER_NAME: &str = "stasis.dev/owner-name";
pub const ORDINAL: &str = "stasis.dev/ordinal";
/// A checkpoint this often, left running, so that an eviction has little left to upload: a
/// duration as Kubernetes writes them ("10m", "1h30m", "90s").
pub const CHECKPOINT_EVERY: &str = "stasis.dev/checkpoint-every";
/// "true": a checkpoint is restored into the pod whatever image its container ran (a new
/// build of the same program, say); by default only into a container of the same image.
pub const ANY_IMAGE: &str = "stasis.dev/any-image";

/// The image a container runs, as containerd and CRI-O annotate it.
const IMAGE_ANNOTATIONS: [&str; 2] = ["io.kubernetes.cri.image-name", "io.kubernetes.cri-o.ImageName"];

/// The character devices' major number of NVIDIA's GPUs: minor N is `/dev/nvidiaN`, the
/// highest minors are the driver's own (`nvidiactl` 255, `nvidia-modeset` 254).
const NVIDIA_MAJOR: i64 = 195;
const NVIDIA_FIRST_CONTROL_MINOR: i64 = 254;

/// Where an opted-in container finds stasis: the pod bundle and the pod endpoint's directory
/// (host paths), mounted read-only at fixed paths inside.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Injection {
    pub bundle: PathBuf,
    pub endpoint_dir: PathBuf,
}

/// Where they appear inside the container (what stasis-pod and stasisd expect).
pub const BUNDLE_MOUNT: &str = "/.stasis";
pub const ENDPOINT_MOUNT: &str = "/.stasis-run";

pub fn opted_in(pod: &PodSandbox) -> bool {
    pod.labels.get(OPT_IN).is_some_and(|v| v == "true")
}

/// What stasisd is told of a started container of an opted-in pod (its init's pid included).
pub fn registration(pod: &PodSandbox, container: &Container) -> RegisterContainerRequest {
    let annotation = |key: &str| pod.annotations.get(key).cloned().unwrap_or_default();
    let (owner_kind, owner_name) = match (annotation(OWNER_KIND), annotation(OWNER_NAME)) {
        (kind, name) if !kind.is_empty() && !name.is_empty() => (kind, name),
        _ => ("Pod".to_owned(), pod.name.clone()),
    };
    let image =
        IMAGE_ANNOTATIONS.iter().find_map(|k| container.annotations.get(*k)).cloned().unwrap_or_default();
    RegisterContainerRequest {
        id: container.id.clone(),
        init_pid: container.pid as i32,
        image,
        namespace: pod.namespace.clone(),
        owner_kind,
        owner_name,
        ordinal: annotation(ORDINAL),
        container: container.name.clone(),
        checkpoint_every_ms: pod.annotations.get(CHECKPOINT_EVERY).and_then(|d| millis(d)).unwrap_or(0),
        any_image: annotation(ANY_IMAGE) == "true",
        gpu_devices: gpu_devices(container),
    }
}

/// The NVIDIA GPU device files a container was given (by a device plugin or CDI, which the
/// runtime has resolved into its devices by now), sorted.
fn gpu_devices(container: &Container) -> Vec<String> {
    let is_gpu = |d: &&LinuxDevice| {
        d.r#type == "c" && d.major == NVIDIA_MAJOR && (0..NVIDIA_FIRST_CONTROL_MINOR).contains(&d.minor)
    };
    let devices = container.linux.as_ref().map(|l| l.devices.as_slice()).unwrap_or_default();
    let mut gpus: Vec<String> = devices.iter().filter(is_gpu).map(|d| d.path.clone()).collect();
    gpus.sort();
    gpus
}

/// Milliseconds of a duration as stasis reads them everywhere (Kubernetes' "1h30m", and
/// "1.5h" as the CLI takes it); `None` for anything else, a unit being needed.
fn millis(text: &str) -> Option<u64> {
    stasis_duration::parse(text).ok().and_then(|d| u64::try_from(d.as_millis()).ok())
}

/// What an opted-in container is given as it is created: the bundle and the endpoint, and
/// the endpoint's path for stasis-pod.
pub fn adjustment(injection: &Injection) -> ContainerAdjustment {
    let mount = |source: &PathBuf, destination: &str| Mount {
        destination: destination.into(),
        r#type: "bind".into(),
        source: source.display().to_string(),
        options: ["rbind", "ro", "nosuid", "nodev"].map(String::from).to_vec(),
    };
    ContainerAdjustment {
        annotations: Default::default(),
        mounts: vec![mount(&injection.bundle, BUNDLE_MOUNT), mount(&injection.endpoint_dir, ENDPOINT_MOUNT)],
        env: vec![KeyValue { key: "STASIS_POD_SOCKET".into(), value: format!("{ENDPOINT_MOUNT}/pod.sock") }],
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn pod(labels: &[(&str, &str)], annotations: &[(&str, &str)]) -> PodSandbox {
        let map = |kv: &[(&str, &str)]| kv.iter().map(|(k, v)| (k.to_string(), v.to_string())).collect();
        PodSandbox {
            id: "sb".into(),
            name: "trainer-2".into(),
            uid: "u".into(),
            namespace: "ml".into(),
            labels: map(labels),
            annotations: map(annotations),
        }
    }

    fn container() -> Container {
        Container {
            id: "c1".into(),
            name: "main".into(),
            pid: 4242,
            annotations: [("io.kubernetes.cri.image-name".to_string(), "example/train:1".to_string())].into(),
            ..Default::default()
        }
    }

    #[test]
    fn only_the_label_opts_in() {
        assert!(opted_in(&pod(&[(OPT_IN, "true")], &[])));
        assert!(!opted_in(&pod(&[(OPT_IN, "false")], &[])));
        assert!(!opted_in(&pod(&[], &[(OPT_IN, "true")])));
    }

    #[test]
    fn the_webhook_s_owner_annotations_name_the_identity() {
        let owned = pod(&[], &[(OWNER_KIND, "StatefulSet"), (OWNER_NAME, "trainer"), (ORDINAL, "2")]);
        let r = registration(&owned, &container());
        assert_eq!(
            (r.namespace.as_str(), r.owner_kind.as_str(), r.owner_name.as_str(), r.ordinal.as_str()),
            ("ml", "StatefulSet", "trainer", "2")
        );
        assert_eq!((r.container.as_str(), r.init_pid, r.image.as_str()), ("main", 4242, "example/train:1"));
        assert!(!r.any_image, "the same image only, unless the pod says otherwise");
        assert!(registration(&pod(&[], &[(ANY_IMAGE, "true")]), &container()).any_image);
    }

    #[test]
    fn the_nvidia_gpus_among_a_container_s_devices_are_reported() {
        let device = |path: &str, kind: &str, major, minor| LinuxDevice {
            path: path.into(),
            r#type: kind.into(),
            major,
            minor,
        };
        let mut gpu = container();
        gpu.linux = Some(stasis_proto::nri::LinuxContainer {
            devices: vec![
                device("/dev/nvidia1", "c", 195, 1),
                device("/dev/nvidiactl", "c", 195, 255),
                device("/dev/nvidia-modeset", "c", 195, 254),
                device("/dev/nvidia-uvm", "c", 508, 0),
                device("/dev/fuse", "c", 10, 229),
                device("/dev/nvidia0", "c", 195, 0),
            ],
        });
        assert_eq!(registration(&pod(&[], &[]), &gpu).gpu_devices, ["/dev/nvidia0", "/dev/nvidia1"]);
        assert!(registration(&pod(&[], &[]), &container()).gpu_devices.is_empty());
    }

    #[test]
    fn a_pod_without_them_is_its_own_owner() {
        let r = registration(&pod(&[], &[]), &container());
        assert_eq!(
            (r.owner_kind.as_str(), r.owner_name.as_str(), r.ordinal.as_str()),
            ("Pod", "trainer-2", "")
        );
    }

    #[test]
    fn the_periodic_checkpoint_annotation_is_a_kubernetes_duration() {
        let every =
            |d: &str| registration(&pod(&[], &[(CHECKPOINT_EVERY, d)]), &container()).checkpoint_every_ms;
        assert_eq!(every("10m"), 600_000);
        assert_eq!(every("1h30m"), 5_400_000);
        assert_eq!(every("1500ms"), 1_500);
        assert_eq!(every("1.5h"), 5_400_000, "as the CLI takes it");
        assert_eq!(every("often"), 0, "not a duration: none");
        assert_eq!(every("10"), 0, "a unit is needed");
    }

    #[test]
    fn the_bundle_and_the_endpoint_are_mounted_read_only() {
        let adjust = adjustment(&Injection {
            bundle: "/var/lib/stasis/pod-bundle".into(),
            endpoint_dir: "/run/stasis/pod".into(),
        });
        let mounts: Vec<(&str, &str)> =
            adjust.mounts.iter().map(|m| (m.source.as_str(), m.destination.as_str())).collect();
        assert_eq!(mounts, [("/var/lib/stasis/pod-bundle", "/.stasis"), ("/run/stasis/pod", "/.stasis-run")]);
        assert!(adjust.mounts.iter().all(|m| m.options.contains(&"ro".to_string())));
        assert_eq!(adjust.env[0].value, "/.stasis-run/pod.sock");
    }
}
