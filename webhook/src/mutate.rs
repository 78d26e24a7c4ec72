//! What an opted-in pod needs, as JSONPatch operations: its owner recorded, each container's
//! command run by stasis-pod, its preStop hook asking for the eviction checkpoint (and told
//! the grace period), a startup probe that passes once the job runs (restored or afresh), and
//! a grace period long enough for the checkpoint to be made durable.

use serde_json::{Value, json};

use crate::owner::{self, OWNER_KIND, OWNER_NAME};
use crate::quantity;

/// The label a pod opts in with.
pub const OPT_IN: &str = "stasis.dev/checkpoint";
/// Set on every pod this webhook prepared: a second pass leaves it alone.
pub const PREPARED: &str = "stasis.dev/prepared";
/// Where the NRI plugin mounts the pod bundle in the container.
const BUNDLE: &str = "/.stasis";
/// The grace period the kubelet gives a pod that asks for none.
const DEFAULT_GRACE_SECS: u64 = 30;
/// Startup probes (one a second) a restore may take before the kubelet gives up on it.
const STARTUP_PROBES: u64 = 600;

/// What the grace period is sized by.
#[derive(Debug, Clone, PartialEq)]
pub struct Sizing {
    /// Bytes per second the node's store takes (measured, or a conservative guess).
    pub store_bytes_per_sec: u64,
    /// Device memory per GPU a pod asks for (`nvidia.com/gpu`).
    pub gpu_memory_bytes: u64,
    /// Time besides the upload: freezing, the GPU phase, CRIU, the hook's own start.
    pub margin_secs: u64,
}

/// What to do with a pod.
#[derive(Debug, Clone, PartialEq)]
pub enum Decision {
    /// Not opted in, or prepared already.
    Untouched,
    Patch {
        ops: Vec<Value>,
        warnings: Vec<String>,
    },
    /// Opted in, but stasis cannot protect it as it is: why.
    Refuse(String),
}

/// The decision for `pod` (a Pod object).
pub fn decide(pod: &Value, sizing: &Sizing) -> Decision {
    let metadata = &pod["metadata"];
    if metadata["labels"][OPT_IN] != "true" || metadata["annotations"][PREPARED].is_string() {
        return Decision::Untouched;
    }
    let spec = &pod["spec"];
    if spec["shareProcessNamespace"] == true {
        return Decision::Refuse(
            "stasis needs each container in a process namespace of its own; this pod sets shareProcessNamespace".into(),
        );
    }
    let Some(containers) = spec["containers"].as_array().filter(|c| !c.is_empty()) else {
        return Decision::Refuse("the pod has no containers".into());
    };
    let current = spec["terminationGracePeriodSeconds"].as_u64().unwrap_or(DEFAULT_GRACE_SECS);
    let grace = current.max(grace_secs(containers, sizing));
    let mut ops = Vec::new();
    for (i, container) in containers.iter().enumerate() {
        let name = container["name"].as_str().unwrap_or("?");
        let Some(command) = strings(&container["command"]) else {
            return Decision::Refuse(format!(
                "container {name} has no command: stasis runs it under stasis-pod and must know it (give command, and args if any)"
            ));
        };
        if !container["lifecycle"]["preStop"].is_null() {
            return Decision::Refuse(format!(
                "container {name} has a preStop hook of its own; stasis' eviction checkpoint is the preStop hook"
            ));
        }
        ops.push(add(&format!("/spec/containers/{i}/command"), json!(stasis_pod(&["run", "--"], &command))));
        let hook = json!({ "exec": { "command": stasis_pod(&["prestop"], &[]) } });
        match container["lifecycle"].is_object() {
            true => ops.push(add(&format!("/spec/containers/{i}/lifecycle/preStop"), hook)),
            false => ops.push(add(&format!("/spec/containers/{i}/lifecycle"), json!({ "preStop": hook }))),
        }
        // The hook knows its time: an eviction that cannot be durable in it is not tried.
        let env = json!({ "name": "STASIS_GRACE_SECONDS", "value": grace.to_string() });
        match container["env"].is_array() {
            true => ops.push(add(&format!("/spec/containers/{i}/env/-"), env)),
            false => ops.push(add(&format!("/spec/containers/{i}/env"), json!([env]))),
        }
        // Not started (so not ready) until the job runs, restored or afresh.
        if container["startupProbe"].is_null() {
            let probe = json!({
                "exec": { "command": stasis_pod(&["ready"], &[]) },
                "periodSeconds": 1,
                "failureThreshold": STARTUP_PROBES,
            });
            ops.push(add(&format!("/spec/containers/{i}/startupProbe"), probe));
        }
    }
    let owner = owner::of(metadata);
    let annotations = [
        (OWNER_KIND, owner.kind.as_str()),
        (OWNER_NAME, owner.name.as_str()),
        (owner::ORDINAL, owner.ordinal.as_str()),
        (PREPARED, "true"),
    ];
    match metadata["annotations"].is_object() {
        true => ops.extend(
            annotations.iter().map(|(k, v)| add(&format!("/metadata/annotations/{}", escape(k)), json!(v))),
        ),
        false => {
            let all: serde_json::Map<String, Value> =
                annotations.iter().map(|(k, v)| (k.to_string(), json!(v))).collect();
            ops.push(add("/metadata/annotations", Value::Object(all)));
        }
    }
    if grace > current {
        ops.push(add("/spec/terminationGracePeriodSeconds", json!(grace)));
    }
    Decision::Patch { ops, warnings: owner.warning.into_iter().collect() }
}

/// Seconds to checkpoint the pod's memory and GPU memory at the store's pace, plus the margin.
fn grace_secs(containers: &[Value], sizing: &Sizing) -> u64 {
    let limit = |c: &Value, key: &str| {
        let resources = &c["resources"];
        resources["limits"][key].as_str().or(resources["requests"][key].as_str()).map(str::to_owned)
    };
    let memory: u64 = containers.iter().filter_map(|c| quantity::bytes(&limit(c, "memory")?)).sum();
    let gpus: u64 = containers.iter().filter_map(|c| limit(c, "nvidia.com/gpu")?.parse::<u64>().ok()).sum();
    let bytes = memory + gpus * sizing.gpu_memory_bytes;
    bytes.div_ceil(sizing.store_bytes_per_sec.max(1)) + sizing.margin_secs
}

/// The command that runs stasis-pod (through the bundle's loader) with `args`, then `rest`.
fn stasis_pod(args: &[&str], rest: &[String]) -> Vec<String> {
    let program = [
        format!("{BUNDLE}/ld.so"),
        "--library-path".into(),
        format!("{BUNDLE}/lib"),
        format!("{BUNDLE}/stasis-pod"),
    ];
    program.into_iter().chain(args.iter().map(|a| a.to_string())).chain(rest.iter().cloned()).collect()
}

fn strings(v: &Value) -> Option<Vec<String>> {
    let list: Vec<String> =
        v.as_array()?.iter().map(|s| s.as_str().map(str::to_owned)).collect::<Option<_>>()?;
    (!list.is_empty()).then_some(list)
}

fn add(path: &str, value: Value) -> Value {
    json!({ "op": "add", "path": path, "value": value })
}

/// A key as a JSON Pointer token.
fn escape(key: &str) -> String {
    key.replace('~', "~0").replace('/', "~1")
}
