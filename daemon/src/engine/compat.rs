//! Whether this node can run a checkpoint taken on another: checked before a restore touches
//! anything, so an incompatible node refuses with the reason instead of CRIU failing halfway
//! or the restored tree crashing on its first instruction this CPU lacks.
//!
//! GPUs (model and memory) are placed by `gpu_map`; sockets by `sockets::check_restore`.

use std::collections::BTreeSet;

use stasis_proto::stasis::store::v1::Manifest;

use crate::criu::CriuVersion;

/// Why `manifest` cannot be restored on a node with `cpu_flags` and CRIU `criu`, if it cannot.
pub fn mismatch(manifest: &Manifest, cpu_flags: &BTreeSet<String>, criu: CriuVersion) -> Option<String> {
    let missing: Vec<&str> =
        manifest.cpu_flags.iter().filter(|f| !cpu_flags.contains(*f)).map(String::as_str).collect();
    if !missing.is_empty() {
        return Some(format!(
            "this node's CPU lacks {} that the CPU of node {} had, and the checkpointed programs may use",
            missing.join(", "),
            manifest.node
        ));
    }
    match manifest.criu_version.parse::<CriuVersion>() {
        Ok(taken) if taken > criu => Some(format!(
            "it was taken with CRIU {taken}, and this node has the older CRIU {criu}, which may not read its images"
        )),
        _ => None,
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn flags(list: &[&str]) -> BTreeSet<String> {
        list.iter().map(|f| f.to_string()).collect()
    }

    const CRIU: CriuVersion = CriuVersion { major: 4, minor: 2, sublevel: 1 };

    #[test]
    fn a_cpu_without_an_extension_the_checkpoint_had_is_refused() {
        let manifest = Manifest {
            node: "gpu-a".into(),
            criu_version: "4.2.1".into(),
            cpu_flags: ["avx2", "avx512f", "sse4_2"].map(String::from).to_vec(),
            ..Default::default()
        };
        let why = mismatch(&manifest, &flags(&["avx2", "sse4_2", "aes"]), CRIU).unwrap();
        assert_eq!(
            why,
            "this node's CPU lacks avx512f that the CPU of node gpu-a had, and the checkpointed programs may use"
        );
        assert_eq!(mismatch(&manifest, &flags(&["avx2", "avx512f", "sse4_2", "aes"]), CRIU), None);
        // A manifest of an older stasis records no flags: nothing to check.
        let old = Manifest { cpu_flags: vec![], ..manifest };
        assert_eq!(mismatch(&old, &flags(&[]), CRIU), None);
    }

    #[test]
    fn a_checkpoint_of_a_newer_criu_is_refused() {
        let newer = Manifest { criu_version: "4.3.0".into(), ..Default::default() };
        assert!(mismatch(&newer, &flags(&[]), CRIU).unwrap().contains("taken with CRIU 4.3.0"));
        for version in ["4.2.1", "4.1", "3.19.0", "unknown"] {
            let m = Manifest { criu_version: version.into(), ..Default::default() };
            assert_eq!(mismatch(&m, &flags(&[]), CRIU), None, "{version}");
        }
    }
}
