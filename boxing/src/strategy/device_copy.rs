//! A device-type change: each rank copies its piece to the other device (host <-> CUDA through
//! `LocalPiece::to_device`); no communication.

use oxiflow_dtype::DType;
use oxiflow_placement::DeviceType;
use oxiflow_sbp::GlobalLayout;

use crate::piece::LocalPiece;
use crate::step::{Step, StepKind};
use crate::BoxingError;

pub(crate) fn plan(before: &GlobalLayout, after: &GlobalLayout, dtype: DType) -> Step {
    let ranks = before.placement().ranks().to_vec();
    let sizes: Vec<u64> = ranks
        .iter()
        .map(|&r| before.local_shape(r).map_or(0, |s| s.numel()) as u64 * dtype.size() as u64)
        .collect();
    Step {
        kind: StepKind::DeviceCopy {
            from: before.placement().device(),
            to: after.placement().device(),
        },
        axis: None,
        groups: ranks.into_iter().map(|r| vec![r]).collect(),
        before: before.clone(),
        after: after.clone(),
        bytes_max: sizes.iter().copied().max().unwrap_or(0),
        bytes_total: sizes.iter().sum(),
    }
}

pub(crate) fn run<P: LocalPiece>(
    to: DeviceType,
    piece: Option<P>,
) -> Result<Option<P>, BoxingError> {
    piece.map(|p| p.to_device(to)).transpose()
}
