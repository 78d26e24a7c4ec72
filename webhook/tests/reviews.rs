//! The webhook against recorded AdmissionReview documents (tests/reviews/): its answers, and
//! its patches applied to the pods they came with.

use base64::Engine as _;
use serde_json::Value;
use stasis_webhook::mutate::Sizing;
use stasis_webhook::review::{ReviewError, answer};

const PRESTOP: [&str; 5] =
    ["/.stasis/ld.so", "--library-path", "/.stasis/lib", "/.stasis/stasis-pod", "prestop"];

fn sizing() -> Sizing {
    Sizing { store_bytes_per_sec: 200_000_000, gpu_memory_bytes: 80 << 30, margin_secs: 30 }
}

fn review(name: &str) -> (Value, Value) {
    let path = format!("{}/tests/reviews/{name}.json", env!("CARGO_MANIFEST_DIR"));
    let body = std::fs::read(&path).unwrap();
    let request: Value = serde_json::from_slice(&body).unwrap();
    let response = answer(&body, &sizing()).unwrap();
    assert_eq!(response["kind"], "AdmissionReview");
    assert_eq!(response["response"]["uid"], request["request"]["uid"], "the answer names the request");
    (request["request"]["object"].clone(), response["response"].clone())
}

/// `pod` with the answer's patch applied.
fn patched(pod: &Value, response: &Value) -> Value {
    assert_eq!(response["patchType"], "JSONPatch");
    let raw = base64::engine::general_purpose::STANDARD.decode(response["patch"].as_str().unwrap()).unwrap();
    let patch: json_patch::Patch = serde_json::from_slice(&raw).unwrap();
    let mut pod = pod.clone();
    json_patch::patch(&mut pod, &patch).unwrap();
    pod
}

fn strings(v: &Value) -> Vec<&str> {
    v.as_array().unwrap().iter().map(|s| s.as_str().unwrap()).collect()
}

#[test]
fn a_statefulset_pod_is_wrapped_hooked_annotated_and_given_time() {
    let (pod, response) = review("statefulset");
    assert_eq!(response["allowed"], true);
    let pod = patched(&pod, &response);
    let main = &pod["spec"]["containers"][0];
    assert_eq!(
        strings(&main["command"]),
        [
            "/.stasis/ld.so",
            "--library-path",
            "/.stasis/lib",
            "/.stasis/stasis-pod",
            "run",
            "--",
            "python",
            "train.py"
        ]
    );
    assert_eq!(strings(&main["args"]), ["--epochs", "90"], "args follow the command, untouched");
    assert_eq!(strings(&main["lifecycle"]["preStop"]["exec"]["command"]), PRESTOP);
    let probe = &main["startupProbe"];
    assert_eq!(strings(&probe["exec"]["command"]).last(), Some(&"ready"), "{probe}");
    assert_eq!((probe["periodSeconds"].as_u64(), probe["failureThreshold"].as_u64()), (Some(1), Some(600)));
    let annotations = &pod["metadata"]["annotations"];
    assert_eq!(annotations["stasis.dev/owner-kind"], "StatefulSet");
    assert_eq!(annotations["stasis.dev/owner-name"], "trainer");
    assert_eq!(annotations["stasis.dev/ordinal"], "1");
    assert_eq!(annotations["stasis.dev/prepared"], "true");
    // 8 GiB of memory and one GPU's 80 GiB at 200 MB/s, plus 30 s.
    let bytes: u64 = (8 << 30) + (80 << 30);
    let grace = bytes.div_ceil(200_000_000) + 30;
    assert_eq!(pod["spec"]["terminationGracePeriodSeconds"], grace);
    assert_eq!(
        main["env"],
        serde_json::json!([{ "name": "STASIS_GRACE_SECONDS", "value": grace.to_string() }])
    );
    assert_eq!(pod["spec"]["containers"][0]["image"], "registry.example/train:3.1");
}

#[test]
fn an_indexed_job_pod_keeps_its_annotations_hooks_and_longer_grace() {
    let (pod, response) = review("indexed_job");
    let pod = patched(&pod, &response);
    let worker = &pod["spec"]["containers"][0];
    assert_eq!(strings(&worker["lifecycle"]["preStop"]["exec"]["command"]), PRESTOP);
    assert_eq!(strings(&worker["lifecycle"]["postStart"]["exec"]["command"]), ["touch", "/tmp/started"]);
    let annotations = &pod["metadata"]["annotations"];
    assert_eq!(annotations["team/owner"], "vision");
    assert_eq!(
        (&annotations["stasis.dev/owner-kind"], &annotations["stasis.dev/ordinal"]),
        (&"Job".into(), &"3".into())
    );
    assert_eq!(pod["spec"]["terminationGracePeriodSeconds"], 600, "a longer grace period stays");
    let env = worker["env"].as_array().unwrap();
    assert_eq!(env.last().unwrap()["value"], "600", "the hook is told the grace period: {env:?}");
    assert_eq!(env[0]["name"], "MODE", "the container's own environment stays first");
}

#[test]
fn pods_not_opted_in_or_prepared_already_pass_untouched() {
    for name in ["not_opted_in", "prepared"] {
        let (_, response) = review(name);
        assert_eq!(response["allowed"], true, "{name}");
        assert!(response["patch"].is_null(), "{name}: {response}");
    }
}

#[test]
fn a_container_without_a_command_is_refused_with_the_reason() {
    let (_, response) = review("no_command");
    assert_eq!(response["allowed"], false);
    let message = response["status"]["message"].as_str().unwrap();
    assert!(message.contains("container kernel has no command"), "{message}");
}

#[test]
fn what_is_not_a_review_is_an_error() {
    let path = format!("{}/tests/reviews/malformed.json", env!("CARGO_MANIFEST_DIR"));
    assert_eq!(answer(&std::fs::read(path).unwrap(), &sizing()), Err(ReviewError::NotAReview));
    assert!(matches!(answer(b"{\"request\": ", &sizing()), Err(ReviewError::NotJson(_))));
}
