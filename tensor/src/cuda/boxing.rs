//! Boxing of device pieces through the NCCL world: the dispatcher's hook that runs a plan on
//! `CudaPiece`s (device buffers straight to NCCL) instead of staging through host memory.

use std::sync::Arc;

use oxiflow_boxing::{execute, LocalPiece, Plan};
use oxiflow_collectives::Backend;

use super::backend::cuda_of;
use super::{bound_runtime, CudaPiece};
use crate::context::Context;
use crate::device::Device;
use crate::dispatch::{from_host_piece, to_host_piece};
use crate::storage::Storage;
use crate::{Result, TensorError};

/// Runs `plan` on a CUDA-capable piece when the world is NCCL and a device is bound; None
/// when the host path applies (CPU worlds, no CUDA in this process).
pub(crate) fn run_boxing_cuda(
    op: &'static str,
    plan: &Plan,
    ctx: &Context,
    piece: Option<&Storage>,
) -> Option<Result<Option<Storage>>> {
    if ctx.world().backend() != Backend::Nccl || bound_runtime().is_none() {
        return None;
    }
    Some(run(op, plan, ctx, piece))
}

fn run(
    op: &'static str,
    plan: &Plan,
    ctx: &Context,
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
        Some(s @ Storage::Cpu(_)) => Some(CudaPiece::Host(to_host_piece(s)?)),
    };
    let out = execute(plan, ctx.world(), input).map_err(|e| berr(e.to_string()))?;
    match out {
        None => Ok(None),
        Some(p) => match p.into_storage() {
            Ok(s) => Ok(Some(Storage::Device(Arc::new(s)))),
            Err(CudaPiece::Host(h)) => from_host_piece(h, Device::Cpu).map(Some),
            Err(other) => Err(berr(format!(
                "unexpected {} piece after boxing",
                other.device()
            ))),
        },
    }
}
