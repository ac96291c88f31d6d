//! Boxing of device pieces through the NCCL world: the CUDA backend's `run_boxing` hook, which
//! runs a plan on `CudaPiece`s (device buffers straight to NCCL) instead of staging through
//! host memory.

use std::sync::Arc;

use oxiflow_boxing::{execute, LocalPiece, Plan};
use oxiflow_collectives::{Backend, SharedComm};

use super::storage::cuda_of;
use super::{bound_runtime, CudaPiece};
use oxiflow_tensor::backend::{array_of_host_piece, host_piece_of};
use oxiflow_tensor::Storage;
use oxiflow_tensor::{Result, TensorError};

/// Runs `plan` on a CUDA-capable piece when the world is NCCL and a device is bound; None
/// when the host path applies (CPU worlds, no CUDA in this process).
pub(crate) fn run_boxing_cuda(
    op: &'static str,
    plan: &Plan,
    world: &SharedComm,
    piece: Option<&Storage>,
) -> Option<Result<Option<Storage>>> {
    if world.backend() != Backend::Nccl || bound_runtime().is_none() {
        return None;
    }
    Some(run(op, plan, world, piece))
}

fn run(
    op: &'static str,
    plan: &Plan,
    world: &SharedComm,
    piece: Option<&Storage>,
) -> Result<Option<Storage>> {
    let berr = |detail: String| TensorError::Boxing {
        op,
        from: plan.from.to_string(),
        to: plan.to.to_string(),
        detail,
    };
    // Device pieces share the tensor's block (the executor never writes into a shared piece).
    let input = match piece {
        None => None,
        Some(s @ Storage::Device(_)) => Some(CudaPiece::from_storage(cuda_of(op, s)?)),
        Some(s @ Storage::Cpu(_)) => Some(CudaPiece::Host(host_piece_of(s)?)),
    };
    let out = execute(plan, world, input).map_err(|e| berr(e.to_string()))?;
    match out {
        None => Ok(None),
        Some(p) => match p.into_storage() {
            Ok(s) => Ok(Some(Storage::Device(Arc::new(s)))),
            Err(CudaPiece::Host(h)) => Ok(Some(Storage::Cpu(array_of_host_piece(h)?))),
            Err(other) => Err(berr(format!(
                "unexpected {} piece after boxing",
                other.device()
            ))),
        },
    }
}
