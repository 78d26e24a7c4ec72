//! A container's stable identity: what stays the same when its pod is recreated, possibly on
//! another node (the pod's UID does not). Its checkpoints are its workload's, named by it.

use super::super::workloads::{CONTAINER_PREFIX, valid_name};

#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct Identity {
    /// The pod's Kubernetes namespace.
    pub namespace: String,
    /// The pod's controller: kind (`StatefulSet`, `Job`, ...) and name; for a bare pod, `Pod`
    /// and the pod's name.
    pub owner_kind: String,
    pub owner_name: String,
    /// Which of the controller's pods: a StatefulSet ordinal, a Job completion index, or an
    /// explicit annotation; empty when the controller has one pod.
    pub ordinal: String,
    /// The container's name in the pod.
    pub container: String,
}

impl std::fmt::Display for Identity {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "{}/{}/{}", self.namespace, self.owner_kind, self.owner_name)?;
        if !self.ordinal.is_empty() {
            write!(f, "/{}", self.ordinal)?;
        }
        write!(f, "/{}", self.container)
    }
}

impl Identity {
    /// The workload name of this identity: `k8s.<namespace>.<kind>.<name>[.<ordinal>].<container>`
    /// (kind in lower case). Kubernetes names hold only lower-case letters, digits, `-` and
    /// `.`; a part with anything else, or an empty one, is refused.
    pub fn workload_name(&self) -> Result<String, String> {
        let kind = self.owner_kind.to_ascii_lowercase();
        let mut parts = vec![
            ("namespace", self.namespace.as_str()),
            ("owner kind", &kind),
            ("owner name", &self.owner_name),
        ];
        if !self.ordinal.is_empty() {
            parts.push(("ordinal", &self.ordinal));
        }
        parts.push(("container", &self.container));
        for (what, part) in &parts {
            if part.is_empty() || !part.chars().all(|c| c.is_ascii_alphanumeric() || matches!(c, '-' | '.')) {
                return Err(format!("the {what} {part:?} is not a Kubernetes name"));
            }
        }
        let parts: Vec<&str> = parts.iter().map(|(_, p)| *p).collect();
        let name = format!("{CONTAINER_PREFIX}{}", parts.join("."));
        match valid_name(&name) {
            true => Ok(name),
            false => Err(format!("the identity {self} makes too long a name ({} characters)", name.len())),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn job(ordinal: &str) -> Identity {
        Identity {
            namespace: "ml".into(),
            owner_kind: "StatefulSet".into(),
            owner_name: "trainer".into(),
            ordinal: ordinal.into(),
            container: "main".into(),
        }
    }

    #[test]
    fn the_name_holds_every_part_and_only_those_given() {
        assert_eq!(job("2").workload_name().unwrap(), "k8s.ml.statefulset.trainer.2.main");
        assert_eq!(job("").workload_name().unwrap(), "k8s.ml.statefulset.trainer.main");
        assert_eq!(job("2").to_string(), "ml/StatefulSet/trainer/2/main");
    }

    #[test]
    fn parts_that_are_not_kubernetes_names_are_refused() {
        let bad = Identity { container: "../x".into(), ..job("0") };
        assert!(bad.workload_name().unwrap_err().contains("container"));
        let empty = Identity { namespace: String::new(), ..job("0") };
        assert!(empty.workload_name().unwrap_err().contains("namespace"));
        let long = Identity { owner_name: "a".repeat(120), ..job("0") };
        assert!(long.workload_name().unwrap_err().contains("too long"));
    }
}
