//! Who a pod is, as stasis keys its checkpoints: its controller (kind and name) and which of
//! the controller's pods it is. Recorded in annotations for the NRI plugin, which sees pods
//! without their owners.

use serde_json::Value;

/// A pod may name its ordinal itself (two replicas of a ReplicaSet must not share one).
pub const ORDINAL: &str = "stasis.dev/ordinal";
pub const OWNER_KIND: &str = "stasis.dev/owner-kind";
pub const OWNER_NAME: &str = "stasis.dev/owner-name";

/// The annotation an Indexed Job gives each of its pods, and the label a StatefulSet gives
/// each of its pods (Kubernetes 1.28 on).
const JOB_INDEX: &str = "batch.kubernetes.io/job-completion-index";
const POD_INDEX: &str = "apps.kubernetes.io/pod-index";

#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Owner {
    pub kind: String,
    pub name: String,
    pub ordinal: String,
    /// What the user should know: an identity several pods may share.
    pub warning: Option<String>,
}

/// The owner of pod `metadata`.
pub fn of(metadata: &Value) -> Owner {
    let text = |v: &Value| v.as_str().map(str::to_owned);
    let annotation = |key: &str| text(&metadata["annotations"][key]);
    let controller = metadata["ownerReferences"]
        .as_array()
        .and_then(|refs| refs.iter().find(|r| r["controller"] == true))
        .and_then(|r| Some((text(&r["kind"])?, text(&r["name"])?)));
    let pod_name = text(&metadata["name"]);
    let (kind, name) = match controller {
        Some(owner) => owner,
        None => ("Pod".to_owned(), pod_name.clone().unwrap_or_default()),
    };
    let derived = match kind.as_str() {
        "StatefulSet" => text(&metadata["labels"][POD_INDEX])
            .or_else(|| pod_name.as_deref().and_then(|n| n.rsplit_once('-')).map(|(_, i)| i.to_owned())),
        "Job" => annotation(JOB_INDEX),
        _ => None,
    };
    let ordinal = annotation(ORDINAL).or(derived).unwrap_or_default();
    let warning = match (kind.as_str(), ordinal.is_empty(), name.is_empty()) {
        (_, _, true) => Some(
            "the pod has no name yet (generateName) and no controller: stasis cannot tell it again"
                .to_owned(),
        ),
        ("ReplicaSet" | "DaemonSet" | "ReplicationController", true, _) => Some(format!(
            "the pods of {kind} {name} share one checkpoint identity; give each its own with the annotation {ORDINAL}"
        )),
        _ => None,
    };
    Owner { kind, name, ordinal, warning }
}

#[cfg(test)]
mod tests {
    use super::*;
    use serde_json::json;

    #[test]
    fn a_statefulset_pod_is_its_set_and_ordinal() {
        let owner = of(&json!({
            "name": "trainer-3",
            "ownerReferences": [{"kind": "StatefulSet", "name": "trainer", "controller": true}]
        }));
        assert_eq!(
            (owner.kind.as_str(), owner.name.as_str(), owner.ordinal.as_str()),
            ("StatefulSet", "trainer", "3")
        );
        assert_eq!(owner.warning, None);
    }

    #[test]
    fn an_indexed_job_pod_is_its_completion_index() {
        let owner = of(&json!({
            "generateName": "train-",
            "annotations": {"batch.kubernetes.io/job-completion-index": "7"},
            "ownerReferences": [{"kind": "Job", "name": "train", "controller": true}]
        }));
        assert_eq!((owner.kind.as_str(), owner.name.as_str(), owner.ordinal.as_str()), ("Job", "train", "7"));
    }

    #[test]
    fn replicas_without_an_ordinal_are_warned_about() {
        let owner = of(&json!({
            "generateName": "web-5d9f-",
            "ownerReferences": [{"kind": "ReplicaSet", "name": "web-5d9f", "controller": true}]
        }));
        assert!(owner.warning.unwrap().contains(ORDINAL));
        let named = of(&json!({
            "annotations": {"stasis.dev/ordinal": "a"},
            "ownerReferences": [{"kind": "ReplicaSet", "name": "web-5d9f", "controller": true}]
        }));
        assert_eq!((named.ordinal.as_str(), named.warning), ("a", None));
    }

    #[test]
    fn a_bare_pod_is_its_own_owner() {
        let owner = of(&json!({"name": "notebook"}));
        assert_eq!(
            (owner.kind.as_str(), owner.name.as_str(), owner.ordinal.as_str()),
            ("Pod", "notebook", "")
        );
    }
}
