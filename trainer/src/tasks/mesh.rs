//! `Mesh`: the job's `[pp, dp, cp, tp]` from the flags and the world size, and the placement of
//! each pipeline stage (`[dp, tp]` over its ranks, `[dp, tp, cp]` with a context-parallel axis).

use oxiflow_placement::{DeviceType, Placement};

use crate::config::ParallelConfig;
use crate::error::TrainError;

/// Pipeline stages x data parallel x context parallel x tensor parallel.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Mesh {
    pub pp: usize,
    pub dp: usize,
    pub cp: usize,
    pub tp: usize,
}

fn layout_err(detail: String) -> TrainError {
    TrainError::Layout { detail }
}

impl Mesh {
    /// The mesh for a world of `world` ranks, or why the flags do not fit it.
    pub fn resolve(p: &ParallelConfig, world: usize) -> Result<Mesh, TrainError> {
        let (pp, cp, tp) = (p.pp, p.cp, p.tp);
        let with_cp = if cp > 1 {
            format!(" x --cp {cp}")
        } else {
            String::new()
        };
        let others = tp.checked_mul(pp).and_then(|n| n.checked_mul(cp));
        let dp = match (p.dp, others) {
            (Some(dp), _) => dp,
            (None, Some(n)) if world.is_multiple_of(n) => world / n,
            (None, _) => {
                return Err(layout_err(format!(
                    "--pp {pp}{with_cp} x --tp {tp} does not divide the world size {world}"
                )))
            }
        };
        if others.and_then(|n| n.checked_mul(dp)) != Some(world) {
            return Err(layout_err(if pp == 1 {
                format!("--dp {dp}{with_cp} x --tp {tp} must equal the world size {world}")
            } else {
                format!(
                    "--pp {pp} x --dp {dp}{with_cp} x --tp {tp} must equal the world size {world}"
                )
            }));
        }
        Ok(Mesh { pp, dp, cp, tp })
    }

    /// Ranks per pipeline stage.
    fn per_stage(&self) -> usize {
        self.dp * self.cp * self.tp
    }

    /// The placement of each stage on `device` (stage s on ranks `s n..(s + 1) n` for the
    /// stage's `n` ranks): `[dp, tp]`, or `[dp, tp, cp]` with a context-parallel axis.
    pub fn stages(&self, device: DeviceType) -> Result<Vec<Placement>, TrainError> {
        let (n, dp, cp, tp) = (self.per_stage(), self.dp, self.cp, self.tp);
        let err = |e: oxiflow_placement::PlacementError| layout_err(e.to_string());
        let axes = if cp > 1 {
            vec![dp, tp, cp]
        } else {
            vec![dp, tp]
        };
        (0..self.pp)
            .map(|s| {
                Placement::new_1d(device, (s * n..(s + 1) * n).collect::<Vec<_>>())
                    .and_then(|p| p.reshaped(axes.clone()))
                    .map_err(err)
            })
            .collect()
    }

    /// Every rank of the job as a 1-d placement.
    pub fn world(&self, device: DeviceType) -> Result<Placement, TrainError> {
        Placement::new_1d(device, (0..self.pp * self.per_stage()).collect::<Vec<_>>())
            .map_err(|e| layout_err(e.to_string()))
    }
}

/// The 2-d placement `[dp, tp]` over ranks `0..dp tp` on `device`.
pub fn mesh_placement(dp: usize, tp: usize, device: DeviceType) -> Result<Placement, TrainError> {
    Mesh {
        pp: 1,
        dp,
        cp: 1,
        tp,
    }
    .stages(device)?
    .pop()
    .ok_or_else(|| layout_err("an empty mesh".into()))
}
