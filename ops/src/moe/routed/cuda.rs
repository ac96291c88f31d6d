//! The routed experts' CUDA kernels, for rows whose experts all live on this rank (no mesh axis
//! splits the experts: a CUDA exchange of rows is not built, and such a call is a typed error
//! naming it). The expert ids are read back once per pass and the rows gathered into expert
//! order (`super::super::cuda`); each expert's SwiGLU runs as cuBLASLt products on its block of
//! rows and slice of the stacked matrices, the gate's activation as one SwiGLU launch over all
//! rows (`crate::swiglu`), and the results are scattered back to row order. The backward
//! recomputes the hidden activations, writes the SwiGLU gradients over them, and leaves an
//! expert no row reaches with zero gradients. Every intermediate is a scratch buffer the
//! executor allocates; f32 (without TF32), bf16 and f16 with f32 accumulation.

use std::sync::Arc;

use oxiflow_cuda::kernel_layer::FloatType;
use oxiflow_cuda::{device_error, CudaKernels, CudaRuntime, CudaStorage};
use oxiflow_dtype::DType;
use oxiflow_tensor::{ExternOp, KernelIo, OutSpec, Result};

use super::super::cuda::{
    blocks, float_type, grouped, move_rows, product, product_plus, spec, zero,
};
use super::RoutedExperts;
use crate::swiglu::cuda::{backward_at as swiglu_backward_at, forward_at as swiglu_forward_at};

/// The sizes of one call: rows `m`, width `c`, hidden width `f`, experts `e`, the float type.
struct Sizes {
    m: usize,
    c: usize,
    f: usize,
    e: usize,
    t: FloatType,
    dtype: DType,
}

impl Sizes {
    /// Bytes of one element.
    fn elem(&self) -> u64 {
        self.t.size() as u64
    }
    /// Address of row `r` of a `[rows, width]` buffer at `base`.
    fn row(&self, base: u64, r: usize, width: usize) -> u64 {
        base + (r * width) as u64 * self.elem()
    }
    /// Address of expert `x`'s `[c, f]` (or `[f, c]`) matrix in a stacked tensor at `base`.
    fn matrix(&self, base: u64, x: usize) -> u64 {
        base + (x * self.c * self.f) as u64 * self.elem()
    }
}

/// Checks the inputs (x, ids, gate, up, down[, dy]).
fn sizes(op: &RoutedExperts, inputs: &[&CudaStorage]) -> Result<Sizes> {
    let name = op.name();
    let [x, _ids, gate, up, down, ..] = inputs else {
        return Err(device_error(name, "expects x, ids, gate, up and down"));
    };
    let (m, c) = (x.shape().dim(0), x.shape().dim(1));
    let (e, f) = (gate.shape().dim(0), gate.shape().dim(2));
    let dtype = x.dtype();
    let t = float_type(name, dtype)?;
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

/// The forward's scratch: rows in expert order `[m, c]`, the gate's and up's products
/// `[m, f]` each, the results in expert order `[m, c]`, the row list.
pub(super) fn forward_scratch(
    _op: &RoutedExperts,
    ins: &[OutSpec],
    _outs: &[OutSpec],
) -> Vec<OutSpec> {
    let (m, c, f, d) = dims_of(ins);
    vec![
        spec(&[m, c], d),
        spec(&[m, f], d),
        spec(&[m, f], d),
        spec(&[m, c], d),
        spec(&[m.div_ceil(2)], DType::I64),
    ]
}

/// The backward's scratch: rows and output gradients in expert order `[m, c]` each, the
/// gate's and up's products `[m, f]` (then their gradients), the activation `[m, f]` (then
/// its gradient), the rows' gradients in expert order `[m, c]`, the row list.
pub(super) fn backward_scratch(
    _op: &RoutedExperts,
    ins: &[OutSpec],
    _outs: &[OutSpec],
) -> Vec<OutSpec> {
    let (m, c, f, d) = dims_of(ins);
    vec![
        spec(&[m, c], d),
        spec(&[m, c], d),
        spec(&[m, f], d),
        spec(&[m, f], d),
        spec(&[m, f], d),
        spec(&[m, c], d),
        spec(&[m.div_ceil(2)], DType::I64),
    ]
}

/// (rows, width, hidden width, dtype) from the input specs.
fn dims_of(ins: &[OutSpec]) -> (usize, usize, usize, DType) {
    let x = &ins[0];
    let f = ins.get(2).map_or(0, |g| g.shape.dim(2));
    (x.shape.dim(0), x.shape.dim(1), f, x.dtype)
}

/// Reads the ids back, uploads the row list into `list` and gathers `sources` (address and
/// width) into their expert-ordered scratch: the rows each expert got.
fn group_rows(
    rt: &Arc<CudaRuntime>,
    name: &'static str,
    s: &Sizes,
    ids: &CudaStorage,
    list: &CudaStorage,
    sources: &[(u64, u64, usize)],
) -> Result<Vec<usize>> {
    let (rows, counts) = grouped(rt, name, ids, s.e)?;
    oxiflow_cuda::kernel_layer::upload(rt, list.ptr(), &rows, name)?;
    for &(from, to, width) in sources {
        move_rows(
            rt,
            name,
            true,
            (from, to),
            (list.ptr(), s.m),
            width * s.elem() as usize,
        )?;
    }
    Ok(counts)
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

pub(super) fn forward(
    op: &RoutedExperts,
    b: &CudaKernels,
    io: KernelIo<'_, CudaKernels>,
) -> Result<()> {
    let name = op.name();
    let rt = b.runtime();
    refuse_expert_split(op)?;
    let s = sizes(op, io.inputs)?;
    let ([x, ids, gate, up, down], [y], [xs, hg, hu, ys, list]) =
        (io.inputs, &*io.outputs, &*io.scratch)
    else {
        return Err(device_error(
            name,
            "expects 5 inputs, 1 output and 5 scratch buffers",
        ));
    };
    if y.shape().dims() != [s.m, s.c] {
        return Err(device_error(
            name,
            format!("output {} for {} rows", y.shape(), s.m),
        ));
    }
    if s.m == 0 || s.c == 0 {
        return Ok(());
    }
    if s.f == 0 || s.e == 0 {
        return zero(rt, name, y);
    }
    let counts = group_rows(rt, name, &s, ids, list, &[(x.ptr(), xs.ptr(), s.c)])?;
    hidden(
        rt,
        &s,
        &counts,
        xs.ptr(),
        (gate.ptr(), up.ptr()),
        (hg.ptr(), hu.ptr()),
    )?;
    // The activation over every row at once, written over the gate's product.
    swiglu_forward_at(rt, name, s.dtype, (hg.ptr(), hu.ptr(), hg.ptr()), s.m * s.f)?;
    for (x, at, r) in blocks(&counts) {
        let (a, o) = (s.row(hg.ptr(), at, s.f), s.row(ys.ptr(), at, s.c));
        product(
            rt,
            s.t,
            (r, s.c, s.f),
            (false, false),
            (a, s.matrix(down.ptr(), x), o),
        )?;
    }
    move_rows(
        rt,
        name,
        false,
        (ys.ptr(), y.ptr()),
        (list.ptr(), s.m),
        s.c * s.elem() as usize,
    )
}

pub(super) fn backward(
    op: &RoutedExperts,
    b: &CudaKernels,
    io: KernelIo<'_, CudaKernels>,
) -> Result<()> {
    let name = op.name();
    let rt = b.runtime();
    refuse_expert_split(op)?;
    let s = sizes(op, io.inputs)?;
    let ([x, ids, gate, up, down, dy], [dx, dgate, dup, ddown], [xs, dys, hg, hu, act, dxs, list]) =
        (io.inputs, &*io.outputs, &*io.scratch)
    else {
        return Err(device_error(
            name,
            "expects 6 inputs, 4 outputs and 7 scratch buffers",
        ));
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
    if s.m == 0 || s.c == 0 {
        return Ok(());
    }
    if s.f == 0 || s.e == 0 {
        return zero(rt, name, dx);
    }
    let sources = [(x.ptr(), xs.ptr(), s.c), (dy.ptr(), dys.ptr(), s.c)];
    let counts = group_rows(rt, name, &s, ids, list, &sources)?;
    hidden(
        rt,
        &s,
        &counts,
        xs.ptr(),
        (gate.ptr(), up.ptr()),
        (hg.ptr(), hu.ptr()),
    )?;
    swiglu_forward_at(
        rt,
        name,
        s.dtype,
        (hg.ptr(), hu.ptr(), act.ptr()),
        s.m * s.f,
    )?;
    // ddown = act^T dy, then the activation's gradient dy down^T over the activation.
    for (x, at, r) in blocks(&counts) {
        let (a, d) = (s.row(act.ptr(), at, s.f), s.row(dys.ptr(), at, s.c));
        product(
            rt,
            s.t,
            (s.f, s.c, r),
            (true, false),
            (a, d, s.matrix(ddown.ptr(), x)),
        )?;
        product(
            rt,
            s.t,
            (r, s.f, s.c),
            (false, true),
            (d, s.matrix(down.ptr(), x), a),
        )?;
    }
    // The gate's and up's gradients over their products.
    swiglu_backward_at(
        rt,
        name,
        s.dtype,
        (hg.ptr(), hu.ptr(), act.ptr()),
        (hg.ptr(), hu.ptr()),
        s.m * s.f,
    )?;
    for (x, at, r) in blocks(&counts) {
        let (a, dg, du) = (
            s.row(xs.ptr(), at, s.c),
            s.row(hg.ptr(), at, s.f),
            s.row(hu.ptr(), at, s.f),
        );
        let (wg, wu) = (s.matrix(gate.ptr(), x), s.matrix(up.ptr(), x));
        let wgrad = (s.c, s.f, r);
        product(
            rt,
            s.t,
            wgrad,
            (true, false),
            (a, dg, s.matrix(dgate.ptr(), x)),
        )?;
        product(
            rt,
            s.t,
            wgrad,
            (true, false),
            (a, du, s.matrix(dup.ptr(), x)),
        )?;
        let o = s.row(dxs.ptr(), at, s.c);
        product(rt, s.t, (r, s.c, s.f), (false, true), (dg, wg, o))?;
        product_plus(rt, s.t, (r, s.c, s.f), (false, true), (du, wu, o), 1.0)?;
    }
    move_rows(
        rt,
        name,
        false,
        (dxs.ptr(), dx.ptr()),
        (list.ptr(), s.m),
        s.c * s.elem() as usize,
    )?;
    Ok(())
}

/// A typed error where a mesh axis splits the experts (the rows would travel between ranks).
fn refuse_expert_split(op: &RoutedExperts) -> Result<()> {
    match &op.peers {
        Some(Ok(p)) if p.len() > 1 => Err(device_error(
            op.name(),
            format!(
                "the experts are split over {} ranks: exchanging routed rows between GPUs is \
                 not built (run the experts whole on each rank, or on CPU ranks)",
                p.len()
            ),
        )),
        Some(Err(e)) => Err(device_error(op.name(), e.clone())),
        _ => Ok(()),
    }
}
