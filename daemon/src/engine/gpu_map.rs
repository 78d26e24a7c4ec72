//! Where a checkpoint's GPUs go on restore: the same GPUs when this node has them, else GPUs
//! named by the user (`--gpu-map OLD=NEW`), else a free GPU of the same model with at least
//! as much memory. A target that cannot take the checkpoint is refused before anything of the
//! restore happens.

use std::collections::HashSet;

use stasis_proto::stasis::store::v1::GpuDevice;

use crate::cuda::{GpuInfo, GpuUuid, format_uuid};

/// Why the checkpoint's GPUs cannot be placed on this node.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum GpuMapError {
    #[error("--gpu-map names {0}, which the checkpoint did not use")]
    UnknownSource(String),
    #[error("--gpu-map names {0}, which this node does not have")]
    UnknownTarget(String),
    #[error(
        "{target} ({target_name}, {target_mib} MiB) cannot take the state of {from} ({from_name}, {from_mib} MiB): restore needs the same GPU model with at least as much memory"
    )]
    Incompatible {
        from: String,
        from_name: String,
        from_mib: u64,
        target: String,
        target_name: String,
        target_mib: u64,
    },
    #[error("no free GPU of model {name} with at least {mib} MiB on this node for {from}")]
    NoCandidate { from: String, name: String, mib: u64 },
}

/// Pairs (checkpoint GPU, target GPU) for every GPU of the checkpoint.
pub fn plan(
    recorded: &[GpuDevice],
    present: &[GpuInfo],
    explicit: &[(GpuUuid, GpuUuid)],
) -> Result<Vec<(GpuUuid, GpuUuid)>, GpuMapError> {
    let recorded_ids: Vec<GpuUuid> =
        recorded.iter().filter_map(|g| g.uuid.as_slice().try_into().ok()).collect();
    for (old, new) in explicit {
        if !recorded_ids.contains(old) {
            return Err(GpuMapError::UnknownSource(format_uuid(old)));
        }
        if !present.iter().any(|p| &p.uuid == new) {
            return Err(GpuMapError::UnknownTarget(format_uuid(new)));
        }
    }
    let mut taken: HashSet<GpuUuid> = explicit.iter().map(|(_, new)| *new).collect();
    let mut pairs = Vec::with_capacity(recorded.len());
    for (gpu, old) in recorded.iter().zip(&recorded_ids) {
        let target = match explicit.iter().find(|(o, _)| o == old) {
            Some((_, new)) => present.iter().find(|p| &p.uuid == new).expect("checked above"),
            None => match present.iter().find(|p| &p.uuid == old) {
                Some(same) => same,
                None => present
                    .iter()
                    .find(|p| !taken.contains(&p.uuid) && !recorded_ids.contains(&p.uuid) && fits(gpu, p))
                    .ok_or_else(|| GpuMapError::NoCandidate {
                        from: format_uuid(old),
                        name: gpu.name.clone(),
                        mib: gpu.total_memory >> 20,
                    })?,
            },
        };
        if !fits(gpu, target) {
            return Err(GpuMapError::Incompatible {
                from: format_uuid(old),
                from_name: gpu.name.clone(),
                from_mib: gpu.total_memory >> 20,
                target: format_uuid(&target.uuid),
                target_name: target.name.clone(),
                target_mib: target.total_memory >> 20,
            });
        }
        taken.insert(target.uuid);
        pairs.push((*old, target.uuid));
    }
    Ok(pairs)
}

fn fits(recorded: &GpuDevice, target: &GpuInfo) -> bool {
    recorded.name == target.name && target.total_memory >= recorded.total_memory
}

#[cfg(test)]
mod tests {
    use super::*;

    fn uuid(n: u8) -> GpuUuid {
        [n; 16]
    }

    fn present(n: u8, name: &str, gib: u64) -> GpuInfo {
        GpuInfo { index: u32::from(n), uuid: uuid(n), name: name.into(), total_memory: gib << 30 }
    }

    fn recorded(n: u8, name: &str, gib: u64) -> GpuDevice {
        GpuDevice { uuid: uuid(n).to_vec(), name: name.into(), total_memory: gib << 30 }
    }

    #[test]
    fn same_gpu_when_present_else_same_model() {
        let node = [present(1, "H100", 80), present(2, "H100", 80)];
        assert_eq!(plan(&[recorded(1, "H100", 80)], &node, &[]).unwrap(), [(uuid(1), uuid(1))]);
        // Another node: the original is gone, a free H100 takes its place.
        assert_eq!(plan(&[recorded(9, "H100", 80)], &node, &[]).unwrap(), [(uuid(9), uuid(1))]);
        // Two GPUs never land on one.
        let two = [recorded(8, "H100", 80), recorded(9, "H100", 80)];
        assert_eq!(plan(&two, &node, &[]).unwrap(), [(uuid(8), uuid(1)), (uuid(9), uuid(2))]);
    }

    #[test]
    fn explicit_maps_and_refusals() {
        let node = [present(1, "H100", 80), present(2, "H200", 141)];
        assert_eq!(
            plan(&[recorded(1, "H100", 80)], &node, &[(uuid(1), uuid(1))]).unwrap(),
            [(uuid(1), uuid(1))]
        );
        let err = plan(&[recorded(1, "H100", 80)], &node, &[(uuid(1), uuid(2))]).unwrap_err();
        assert!(matches!(err, GpuMapError::Incompatible { .. }), "{err}");
        assert!(err.to_string().contains("same GPU model"));
        assert!(matches!(
            plan(&[recorded(1, "H100", 80)], &node, &[(uuid(5), uuid(1))]),
            Err(GpuMapError::UnknownSource(_))
        ));
        assert!(matches!(
            plan(&[recorded(1, "H100", 80)], &node, &[(uuid(1), uuid(7))]),
            Err(GpuMapError::UnknownTarget(_))
        ));
        // Too little memory, or no such model: refused.
        assert!(matches!(
            plan(&[recorded(9, "H200", 200)], &node, &[]),
            Err(GpuMapError::NoCandidate { .. })
        ));
        assert!(matches!(
            plan(&[recorded(9, "B200", 180)], &node, &[]),
            Err(GpuMapError::NoCandidate { .. })
        ));
    }
}
