//! The routed experts' CUDA kernels: the compute over rows whose experts live on this rank
//! (`cuda_rows`), and, where a mesh axis splits the experts, the rows' exchange with the ranks
//! holding their experts around it (`cuda_exchange`). Every intermediate of a known size is a
//! scratch buffer the executor allocates; what an expert's rank receives is sized by the
//! routing and allocated once that is known. f32 (without TF32), bf16 and f16 with f32
//! accumulation.

use oxiflow_cuda::{device_error, CudaKernels, CudaRuntime, CudaStorage};
use oxiflow_dtype::DType;
use oxiflow_tensor::{ExternOp, KernelIo, OutSpec, Peers, Result};

use super::super::cuda::{grouped, rows_and_list, zero};
use super::cuda_exchange::{backward_exchanged, forward_exchanged};
use super::cuda_rows::{backward_rows, forward_rows, sizes, Sizes};
use super::RoutedExperts;

/// Where a mesh axis splits the experts: that axis's ranks (more than one).
fn exchanging(op: &RoutedExperts) -> Result<Option<&Peers>> {
    match &op.peers {
        Some(Ok(p)) if p.len() > 1 => Ok(Some(p)),
        Some(Err(e)) => Err(device_error(op.name(), e.clone())),
        _ => Ok(None),
    }
}

/// The scratch of the forward (`BACKWARD` false) or the backward, with the row list last.
/// The forward's: rows in expert order `[m, c]`, the gate's and up's products `[m, f]` each,
/// the results in expert order `[m, c]`; where the rows travel, the rows in send order and
/// the results come back `[m, c]` each (what the experts' ranks receive is sized by the
/// routing and allocated when it is known). The backward's: rows and output gradients in
/// expert order `[m, c]` each, the gate's and up's products `[m, f]` (then their gradients),
/// the activation `[m, f]` (then its gradient), the rows' gradients in expert order `[m, c]`;
/// where the rows travel, rows, output gradients and the rows' gradients come back `[m, c]`
/// each in send order.
pub(super) fn scratch<const BACKWARD: bool>(
    op: &RoutedExperts,
    ins: &[OutSpec],
    _outs: &[OutSpec],
) -> Vec<OutSpec> {
    let (m, c, f, d) = dims_of(ins);
    let widths: &[usize] = match (matches!(exchanging(op), Ok(Some(_))), BACKWARD) {
        (true, false) => &[c, c],
        (true, true) => &[c, c, c],
        (false, false) => &[c, f, f, c],
        (false, true) => &[c, c, f, f, f, c],
    };
    rows_and_list(m, d, widths)
}

/// (rows, width, hidden width, dtype) from the input specs.
fn dims_of(ins: &[OutSpec]) -> (usize, usize, usize, DType) {
    let x = &ins[0];
    let f = ins.get(2).map_or(0, |g| g.shape.dim(2));
    (x.shape.dim(0), x.shape.dim(1), f, x.dtype)
}

/// The rows of a call on this rank alone grouped by expert, or None when there is nothing to
/// compute: no rows or no width, or no hidden width or no experts (then `out` is zeroed).
fn local_groups(
    rt: &CudaRuntime,
    name: &'static str,
    s: &Sizes,
    ids: &CudaStorage,
    out: &CudaStorage,
) -> Result<Option<(Vec<i32>, Vec<usize>)>> {
    if s.m == 0 || s.c == 0 {
        return Ok(None);
    }
    if s.f == 0 || s.e == 0 {
        zero(rt, name, out)?;
        return Ok(None);
    }
    grouped(rt, name, ids, s.e).map(Some)
}

pub(super) fn forward(
    op: &RoutedExperts,
    b: &CudaKernels,
    io: KernelIo<'_, CudaKernels>,
) -> Result<()> {
    let name = op.name();
    let rt = b.runtime();
    let s = sizes(op, io.inputs)?;
    let ([x, ids, gate, up, down], [y]) = (io.inputs, &*io.outputs) else {
        return Err(device_error(name, "expects 5 inputs and 1 output"));
    };
    if y.shape().dims() != [s.m, s.c] {
        return Err(device_error(
            name,
            format!("output {} for {} rows", y.shape(), s.m),
        ));
    }
    let weights = (gate.ptr(), up.ptr(), down.ptr());
    if let Some(peers) = exchanging(op)? {
        let [xs, ys, list] = &*io.scratch else {
            return Err(device_error(name, "expects 3 scratch buffers"));
        };
        return forward_exchanged(b, name, &s, peers, (*x, *ids, y), weights, [xs, ys, list]);
    }
    let [xs, hg, hu, ys, list] = &*io.scratch else {
        return Err(device_error(name, "expects 5 scratch buffers"));
    };
    let Some(g) = local_groups(rt, name, &s, ids, y)? else {
        return Ok(());
    };
    let sc = [xs, hg, hu, ys, list].map(|p| p.ptr());
    forward_rows(rt, name, &s, &g, (x.ptr(), y.ptr()), weights, sc)
}

pub(super) fn backward(
    op: &RoutedExperts,
    b: &CudaKernels,
    io: KernelIo<'_, CudaKernels>,
) -> Result<()> {
    let name = op.name();
    let rt = b.runtime();
    let s = sizes(op, io.inputs)?;
    let ([x, ids, gate, up, down, dy], [dx, dgate, dup, ddown]) = (io.inputs, &*io.outputs) else {
        return Err(device_error(name, "expects 6 inputs and 4 outputs"));
    };
    let out_fits = dy.shape().dims() == [s.m, s.c]
        && dx.shape().dims() == [s.m, s.c]
        && dgate.shape() == gate.shape()
        && dup.shape() == up.shape()
        && ddown.shape() == down.shape();
    if !out_fits {
        return Err(device_error(
            name,
            format!(
                "dy {} and gradients for rows {} and {} experts",
                dy.shape(),
                x.shape(),
                s.e
            ),
        ));
    }
    // Experts no row reaches (and every expert of an empty call) keep zero gradients.
    for g in [dgate, dup, ddown] {
        zero(rt, name, g)?;
    }
    let weights = (gate.ptr(), up.ptr(), down.ptr());
    let grads = (dgate.ptr(), dup.ptr(), ddown.ptr());
    if let Some(peers) = exchanging(op)? {
        let [xs, dys, dxs, list] = &*io.scratch else {
            return Err(device_error(name, "expects 4 scratch buffers"));
        };
        let rows = (*x, *dy, *ids, dx);
        let sc = [xs, dys, dxs, list];
        return backward_exchanged(b, name, &s, peers, rows, (weights, grads), sc);
    }
    let [xs, dys, hg, hu, act, dxs, list] = &*io.scratch else {
        return Err(device_error(name, "expects 7 scratch buffers"));
    };
    let Some(g) = local_groups(rt, name, &s, ids, dx)? else {
        return Ok(());
    };
    let sc = [xs, dys, hg, hu, act, dxs, list].map(|p| p.ptr());
    let rows = (x.ptr(), dy.ptr(), dx.ptr());
    backward_rows(rt, name, &s, &g, rows, (weights, grads), sc)
}
