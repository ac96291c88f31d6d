//! `Mesh`: the job's `[pp, dp, tp]` from the flags and the world size, and the placement of each
//! pipeline stage (`[dp, tp]` over its ranks).

use oxiflow_placement::{DeviceType, Placement};

use crate::config::ParallelConfig;
use crate::error::TrainError;

/// Pipeline stages x data parallel x tensor parallel.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Mesh {
    pub pp: usize,
    pub dp: usize,
    pub tp: usize,
}

fn layout_err(detail: String) -> TrainError {
    TrainError::Layout { detail }
}

impl Mesh {
    /// The mesh for a world of `world` ranks, or why the flags do not fit it.
    pub fn resolve(p: &ParallelConfig, world: usize) -> Result<Mesh, TrainError> {
        let (pp, tp) = (p.pp, p.tp);
        let dp = match p.dp {
            Some(dp) => dp,
            None if tp.checked_mul(pp).is_some_and(|n| world.is_multiple_of(n)) => {
                world / (tp * pp)
            }
            None => {
                return Err(layout_err(format!(
                    "--pp {pp} x --tp {tp} does not divide the world size {world}"
                )))
            }
        };
        if dp.checked_mul(tp).and_then(|n| n.checked_mul(pp)) != Some(world) {
            return Err(layout_err(if pp == 1 {
                format!("--dp {dp} x --tp {tp} must equal the world size {world}")
            } else {
                format!("--pp {pp} x --dp {dp} x --tp {tp} must equal the world size {world}")
            }));
        }
        Ok(Mesh { pp, dp, tp })
    }

    /// The `[dp, tp]` placement of each stage on `device` (stage s on ranks
    /// `s dp tp..(s + 1) dp tp`).
    pub fn stages(&self, device: DeviceType) -> Result<Vec<Placement>, TrainError> {
        let (pp, dp, tp) = (self.pp, self.dp, self.tp);
        let err = |e: oxiflow_placement::PlacementError| layout_err(e.to_string());
        (0..pp)
            .map(|s| {
                Placement::new_1d(device, (s * dp * tp..(s + 1) * dp * tp).collect::<Vec<_>>())
                    .and_then(|p| p.reshaped([dp, tp]))
                    .map_err(err)
            })
            .collect()
    }

    /// Every rank of the job as a 1-d placement.
    pub fn world(&self, device: DeviceType) -> Result<Placement, TrainError> {
        Placement::new_1d(device, (0..self.pp * self.dp * self.tp).collect::<Vec<_>>())
            .map_err(|e| layout_err(e.to_string()))
    }
}

/// The 2-d placement `[dp, tp]` over ranks `0..dp tp` on `device`.
pub fn mesh_placement(dp: usize, tp: usize, device: DeviceType) -> Result<Placement, TrainError> {
    Mesh { pp: 1, dp, tp }
        .stages(device)?
        .pop()
        .ok_or_else(|| layout_err("an empty mesh".into()))
}
