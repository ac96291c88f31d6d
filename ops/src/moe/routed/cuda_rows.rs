//! The routed experts' CUDA compute over rows whose experts all live on this rank: the expert
//! ids grouped on the host into expert order (`super::super::cuda`), the rows gathered into that
//! order, each expert's SwiGLU as cuBLASLt products on its block of rows and slice of the
//! stacked matrices, the gate's activation as one SwiGLU launch over all rows
//! (`crate::swiglu`), and the results scattered back to row order. The backward recomputes
//! the hidden activations and writes the SwiGLU gradients over them.

use std::sync::Arc;

use oxiflow_cuda::kernel_layer::{upload, FloatType};
use oxiflow_cuda::{device_error, CudaRuntime, CudaStorage};
use oxiflow_dtype::DType;
use oxiflow_tensor::{ExternOp, Result};

use super::super::cuda::{blocks, move_rows, product, product_plus};
use super::RoutedExperts;
use crate::operand_dtypes::cuda_float_type;
use crate::swiglu::cuda::{backward_at as swiglu_backward_at, forward_at as swiglu_forward_at};

/// The sizes of one call: rows `m`, width `c`, hidden width `f`, experts `e`, the float type.
#[derive(Clone, Copy)]
pub(super) struct Sizes {
    pub m: usize,
    pub c: usize,
    pub f: usize,
    pub e: usize,
    pub t: FloatType,
    pub dtype: DType,
}

impl Sizes {
    /// Bytes of one element.
    pub fn elem(&self) -> u64 {
        self.t.size() as u64
    }
    /// Address of row `r` of a `[rows, width]` buffer at `base`.
    pub fn row(&self, base: u64, r: usize, width: usize) -> u64 {
        base + (r * width) as u64 * self.elem()
    }
    /// Address of expert `x`'s `[c, f]` (or `[f, c]`) matrix in a stacked tensor at `base`.
    pub fn matrix(&self, base: u64, x: usize) -> u64 {
        base + (x * self.c * self.f) as u64 * self.elem()
    }
}

/// Checks the inputs (x, ids, gate, up, down[, dy]).
pub(super) fn sizes(op: &RoutedExperts, inputs: &[&CudaStorage]) -> Result<Sizes> {
    let name = op.name();
    let [x, _ids, gate, up, down, ..] = inputs else {
        return Err(device_error(name, "expects x, ids, gate, up and down"));
    };
    let (m, c) = (x.shape().dim(0), x.shape().dim(1));
    let (e, f) = (gate.shape().dim(0), gate.shape().dim(2));
    let dtype = x.dtype();
    let t = cuda_float_type(name, dtype)?;
    let fits = x.shape().ndim() == 2
        && gate.shape().dims() == [e, c, f]
        && up.shape().dims() == [e, c, f]
        && down.shape().dims() == [e, f, c]
        && [gate, up, down].iter().all(|w| w.dtype() == dtype);
    if !fits {
        return Err(device_error(
            name,
            format!(
                "rows {} against gate {}, up {} and down {}",
                x.shape(),
                gate.shape(),
                up.shape(),
                down.shape()
            ),
        ));
    }
    Ok(Sizes {
        m,
        c,
        f,
        e,
        t,
        dtype,
    })
}

/// Uploads the row list of `g` into `list` and gathers `sources` (address and width) into
/// their expert-ordered scratch: the rows each expert got.
fn group_rows(
    rt: &Arc<CudaRuntime>,
    name: &'static str,
    s: &Sizes,
    g: &(Vec<i32>, Vec<usize>),
    list: u64,
    sources: &[(u64, u64, usize)],
) -> Result<()> {
    upload(rt, list, &g.0, name)?;
    for &(from, to, width) in sources {
        move_rows(
            rt,
            name,
            true,
            (from, to),
            (list, s.m),
            width * s.elem() as usize,
        )?;
    }
    Ok(())
}

/// Each expert's `[r, c] @ [c, f]` products of its rows with its gate and up matrices into
/// `hg` and `hu`.
fn hidden(
    rt: &Arc<CudaRuntime>,
    s: &Sizes,
    counts: &[usize],
    xs: u64,
    (gate, up): (u64, u64),
    (hg, hu): (u64, u64),
) -> Result<()> {
    for (x, at, r) in blocks(counts) {
        let a = s.row(xs, at, s.c);
        let dims = (r, s.f, s.c);
        product(
            rt,
            s.t,
            dims,
            (false, false),
            (a, s.matrix(gate, x), s.row(hg, at, s.f)),
        )?;
        product(
            rt,
            s.t,
            dims,
            (false, false),
            (a, s.matrix(up, x), s.row(hu, at, s.f)),
        )?;
    }
    Ok(())
}

/// The stacked matrices gate, up and down (addresses).
pub(super) type Weights = (u64, u64, u64);

/// The forward over `s.m` rows at `x` grouped by expert as `g` into `y`, on scratch
/// `[xs, hg, hu, ys, list]` (addresses).
pub(super) fn forward_rows(
    rt: &Arc<CudaRuntime>,
    name: &'static str,
    s: &Sizes,
    g: &(Vec<i32>, Vec<usize>),
    (x, y): (u64, u64),
    (gate, up, down): Weights,
    [xs, hg, hu, ys, list]: [u64; 5],
) -> Result<()> {
    if s.m == 0 {
        return Ok(());
    }
    group_rows(rt, name, s, g, list, &[(x, xs, s.c)])?;
    hidden(rt, s, &g.1, xs, (gate, up), (hg, hu))?;
    // The activation over every row at once, written over the gate's product.
    swiglu_forward_at(rt, name, s.dtype, (hg, hu, hg), s.m * s.f)?;
    for (e, at, r) in blocks(&g.1) {
        let (a, o) = (s.row(hg, at, s.f), s.row(ys, at, s.c));
        product(
            rt,
            s.t,
            (r, s.c, s.f),
            (false, false),
            (a, s.matrix(down, e), o),
        )?;
    }
    move_rows(
        rt,
        name,
        false,
        (ys, y),
        (list, s.m),
        s.c * s.elem() as usize,
    )
}

/// The backward over `s.m` rows `x` with output gradients `dy`, grouped as `g`: the rows'
/// gradients into `dx` and the weight gradients (zeroed by the caller) into `grads`, on
/// scratch `[xs, dys, hg, hu, act, dxs, list]` (addresses).
pub(super) fn backward_rows(
    rt: &Arc<CudaRuntime>,
    name: &'static str,
    s: &Sizes,
    g: &(Vec<i32>, Vec<usize>),
    (x, dy, dx): (u64, u64, u64),
    ((gate, up, down), (dgate, dup, ddown)): (Weights, Weights),
    [xs, dys, hg, hu, act, dxs, list]: [u64; 7],
) -> Result<()> {
    if s.m == 0 {
        return Ok(());
    }
    group_rows(rt, name, s, g, list, &[(x, xs, s.c), (dy, dys, s.c)])?;
    let counts = &g.1;
    hidden(rt, s, counts, xs, (gate, up), (hg, hu))?;
    swiglu_forward_at(rt, name, s.dtype, (hg, hu, act), s.m * s.f)?;
    // ddown = act^T dy, then the activation's gradient dy down^T over the activation.
    for (e, at, r) in blocks(counts) {
        let (a, d) = (s.row(act, at, s.f), s.row(dys, at, s.c));
        product(
            rt,
            s.t,
            (s.f, s.c, r),
            (true, false),
            (a, d, s.matrix(ddown, e)),
        )?;
        product(
            rt,
            s.t,
            (r, s.f, s.c),
            (false, true),
            (d, s.matrix(down, e), a),
        )?;
    }
    // The gate's and up's gradients over their products.
    swiglu_backward_at(rt, name, s.dtype, (hg, hu, act), (hg, hu), s.m * s.f)?;
    for (e, at, r) in blocks(counts) {
        let (a, dg, du) = (s.row(xs, at, s.c), s.row(hg, at, s.f), s.row(hu, at, s.f));
        let (wg, wu) = (s.matrix(gate, e), s.matrix(up, e));
        let wgrad = (s.c, s.f, r);
        product(rt, s.t, wgrad, (true, false), (a, dg, s.matrix(dgate, e)))?;
        product(rt, s.t, wgrad, (true, false), (a, du, s.matrix(dup, e)))?;
        let o = s.row(dxs, at, s.c);
        product(rt, s.t, (r, s.c, s.f), (false, true), (dg, wg, o))?;
        product_plus(rt, s.t, (r, s.c, s.f), (false, true), (du, wu, o), 1.0)?;
    }
    move_rows(
        rt,
        name,
        false,
        (dxs, dx),
        (list, s.m),
        s.c * s.elem() as usize,
    )
}
