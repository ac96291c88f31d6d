//! The job's mesh from the flags: the one table from the layout flags to named axes (in mesh
//! order), resolved against the world size into a `MeshLayout` whose stages are named meshes.

use oxiflow_placement::{AxisKind, DeviceType, MeshLayout, NamedMesh, CP, DP, EP, PP, TP};

use crate::config::ParallelConfig;
use crate::error::TrainError;

/// The axes the layout flags ask for, in mesh order, with their sizes (`--dp` None: the world
/// size over the others). The expert-parallel ranks are data-parallel ranks too: `--dp D
/// --ep E` is a dp axis of D / E and an ep axis of E, the batch split over both.
pub fn requested_axes(p: &ParallelConfig) -> [(AxisKind, Option<usize>); 5] {
    [
        (PP, Some(p.pp)),
        (DP, p.dp.map(|d| d / p.ep.max(1))),
        (EP, Some(p.ep)),
        (CP, Some(p.cp)),
        (TP, Some(p.tp)),
    ]
}

/// The mesh of the flags for a world of `world` ranks, or why they do not fit it.
pub fn job_mesh(p: &ParallelConfig, world: usize) -> Result<MeshLayout, TrainError> {
    Ok(MeshLayout::resolve(&requested_axes(p), world)?)
}

/// The named mesh `[dp, tp]` over ranks `0..dp tp` on `device`.
pub fn mesh_placement(dp: usize, tp: usize, device: DeviceType) -> Result<NamedMesh, TrainError> {
    MeshLayout::resolve(&[(DP, Some(dp)), (TP, Some(tp))], dp.saturating_mul(tp))?
        .stages(device)?
        .pop()
        .ok_or_else(|| TrainError::Layout {
            detail: "an empty mesh".into(),
        })
}
