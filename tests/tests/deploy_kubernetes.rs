//! The Kubernetes manifests in deploy/kubernetes/ agree with the programs they run: every flag
//! a container passes is one its program takes, and the paths the parts share (the sockets,
//! the pod bundle) are the same in each.

#![forbid(unsafe_code)]

use std::path::Path;
use std::process::Command;

/// Each container of `yaml` as (program, its `--flags`), from `command: ["program"]` and the
/// `- --flag=value` lines of its `args:` after it.
fn containers(yaml: &str) -> Vec<(String, Vec<String>)> {
    let mut found: Vec<(String, Vec<String>)> = Vec::new();
    for line in yaml.lines().map(str::trim) {
        if let Some(program) = line.strip_prefix("command: [\"").and_then(|rest| rest.split('"').next()) {
            found.push((program.to_owned(), Vec::new()));
        } else if let (Some(flag), Some((_, flags))) = (line.strip_prefix("- --"), found.last_mut()) {
            flags.push(format!("--{}", flag.split('=').next().unwrap_or(flag)));
        }
    }
    found
}

#[test]
fn every_flag_the_manifests_pass_is_one_their_program_takes() {
    let dir = Path::new(env!("CARGO_MANIFEST_DIR")).join("../deploy/kubernetes");
    let mut checked = 0;
    for name in ["daemonset.yaml", "webhook.yaml"] {
        let yaml = std::fs::read_to_string(dir.join(name)).expect(name);
        for (program, flags) in containers(&yaml).into_iter().filter(|(p, _)| p.starts_with("stasis")) {
            let help = Command::new(stasis_tests::bin(&program)).arg("--help").output().expect(&program);
            let help = String::from_utf8_lossy(&help.stdout);
            for flag in flags {
                assert!(help.contains(&flag), "{name}: {program} takes no {flag}");
                checked += 1;
            }
        }
    }
    assert!(checked >= 12, "only {checked} flags found: the manifests changed shape");
}

#[test]
fn the_parts_agree_on_the_paths_they_share() {
    let dir = Path::new(env!("CARGO_MANIFEST_DIR")).join("../deploy/kubernetes");
    let daemonset = std::fs::read_to_string(dir.join("daemonset.yaml")).unwrap();
    for shared in [
        "--socket=/run/stasis/stasisd.sock",
        "--stasis-socket=/run/stasis/stasisd.sock",
        "--pod-socket=/run/stasis/pod/pod.sock",
        "--endpoint-dir=/run/stasis/pod",
        "--bundle=/var/lib/stasis/pod-bundle",
        "/host/pod-bundle",
    ] {
        assert!(daemonset.contains(shared), "daemonset.yaml lacks {shared}");
    }
    let webhook = std::fs::read_to_string(dir.join("webhook.yaml")).unwrap();
    assert!(webhook.contains("stasis.dev/checkpoint: \"true\""), "the webhook selects opted-in pods");
    for runtime in ["runtime/containerd.toml", "runtime/crio.conf"] {
        let text = std::fs::read_to_string(dir.join(runtime)).unwrap();
        assert!(text.contains("/var/run/nri/nri.sock"), "{runtime} puts NRI where stasis-nri looks");
    }
}
