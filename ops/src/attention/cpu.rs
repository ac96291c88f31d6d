//! Fused attention CPU kernels, the blocked reference: per (batch, head) pair (rayon over the
//! pairs when large; query head `h` reads key/value head `h / group`), blocks of `QB` queries
//! against blocks of `KB` keys with an online softmax (running row max, sum and output
//! rescaled as each key block arrives), so at most one `[QB, KB]` block of scores exists per
//! pair; o and lse as the op defines them. The backward
//! recomputes each block's probabilities from lse and takes each row's softmax correction from
//! dO . o; a key/value head's dK and dV sum those of its group's query heads. Products by matrixmultiply on strided views of the `[B, T, H, D]` pieces.

use ndarray::linalg::general_mat_mul;
use ndarray::{s, Array2, ArrayD, ArrayView2, ArrayView4, ArrayViewMut2, Ix4};
use rayon::prelude::*;

use oxiflow_tensor::backend::{kernel_err, PAR_THRESHOLD};
use oxiflow_tensor::{
    CpuArray, CpuBackend, FloatElement, KernelIo, Result, TensorElement, TensorError,
};

use super::{FlashAttention, FlashAttentionGrad, FlashAttrs, FlashDims};
use crate::host_slices::through_wide;

/// Queries per block.
const QB: usize = 64;
/// Keys per block.
const KB: usize = 64;

/// The block sizes and masking of one (batch, head) pair.
#[derive(Clone, Copy)]
struct Blocks<F> {
    t: usize,
    s: usize,
    causal: bool,
    scale: F,
}

impl<F: FloatElement> Blocks<F> {
    /// The query blocks `i0..i1` with the end of the keys they attend to.
    fn rows(self) -> impl Iterator<Item = (usize, usize, usize)> {
        (0..self.t).step_by(QB).map(move |i0| {
            let i1 = (i0 + QB).min(self.t);
            let kend = if self.causal { i1.min(self.s) } else { self.s };
            (i0, i1, kend)
        })
    }
    /// How many of key block `j0..j1`'s columns query `i` attends to.
    fn live(self, i: usize, j0: usize, j1: usize) -> usize {
        let cols = j1 - j0;
        if self.causal {
            (i + 1).saturating_sub(j0).min(cols)
        } else {
            cols
        }
    }
}

/// `scale a b^T` into `out` (`[rows, cols]`).
fn scores<F: FloatElement>(
    scale: F,
    a: ArrayView2<'_, F>,
    b: ArrayView2<'_, F>,
    out: &mut ArrayViewMut2<'_, F>,
) {
    general_mat_mul(scale, &a, &b.t(), F::from_f64(0.0), out);
}

/// o `[T, Dv]` (row-major) and lse `[T]` of one pair.
fn forward_pair<F: FloatElement>(
    (q, k, v): (ArrayView2<'_, F>, ArrayView2<'_, F>, ArrayView2<'_, F>),
    bl: Blocks<F>,
) -> (Array2<F>, Vec<F>) {
    let (zero, one, ninf) = (F::from_f64(0.0), F::from_f64(1.0), F::lowest());
    let dv = v.ncols();
    let mut o = Array2::<F>::zeros((bl.t, dv));
    let mut lse = vec![ninf; bl.t];
    let mut block = Array2::<F>::zeros((QB, KB));
    for (i0, i1, kend) in bl.rows() {
        let rows = i1 - i0;
        let (mut m, mut l) = ([ninf; QB], [zero; QB]);
        let mut acc = o.slice_mut(s![i0..i1, ..]);
        for j0 in (0..kend).step_by(KB) {
            let j1 = (j0 + KB).min(kend);
            let mut p = block.slice_mut(s![..rows, ..j1 - j0]);
            scores(
                bl.scale,
                q.slice(s![i0..i1, ..]),
                k.slice(s![j0..j1, ..]),
                &mut p,
            );
            for (r, mut row) in p.outer_iter_mut().enumerate() {
                let live = bl.live(i0 + r, j0, j1);
                let mx = row
                    .iter()
                    .take(live)
                    .fold(ninf, |a, &x| if x > a { x } else { a });
                let m_new = if mx > m[r] { mx } else { m[r] };
                if m_new == ninf {
                    row.fill(zero);
                    continue;
                }
                let alpha = if m[r] == ninf {
                    zero
                } else {
                    (m[r] - m_new).exp()
                };
                let mut sum = zero;
                for (j, x) in row.iter_mut().enumerate() {
                    *x = if j < live { (*x - m_new).exp() } else { zero };
                    sum += *x;
                }
                l[r] = l[r] * alpha + sum;
                m[r] = m_new;
                acc.row_mut(r).mapv_inplace(|a| a * alpha);
            }
            general_mat_mul(one, &p, &v.slice(s![j0..j1, ..]), one, &mut acc);
        }
        for (r, mut row) in acc.outer_iter_mut().enumerate() {
            if l[r] > zero {
                let inv = l[r].recip();
                row.mapv_inplace(|a| a * inv);
                lse[i0 + r] = m[r] + l[r].ln();
            }
        }
    }
    (o, lse)
}

/// dq `[T, D]`, dk `[S, D]`, dv `[S, Dv]` of one pair.
fn backward_pair<F: FloatElement>(
    (q, k, v): (ArrayView2<'_, F>, ArrayView2<'_, F>, ArrayView2<'_, F>),
    (o, d_o): (ArrayView2<'_, F>, ArrayView2<'_, F>),
    lse: &[F],
    bl: Blocks<F>,
) -> [Array2<F>; 3] {
    let (zero, one, ninf) = (F::from_f64(0.0), F::from_f64(1.0), F::lowest());
    let mut dq = Array2::<F>::zeros(q.raw_dim());
    let mut dk = Array2::<F>::zeros(k.raw_dim());
    let mut dv = Array2::<F>::zeros(v.raw_dim());
    // Each row's softmax correction: sum_j P_ij dP_ij = dO_i . o_i.
    let dsum: Vec<F> = d_o
        .outer_iter()
        .zip(o.outer_iter())
        .map(|(a, b)| a.dot(&b))
        .collect();
    let (mut pb, mut db) = (Array2::<F>::zeros((QB, KB)), Array2::<F>::zeros((QB, KB)));
    for (i0, i1, kend) in bl.rows() {
        let rows = i1 - i0;
        let (qi, doi) = (q.slice(s![i0..i1, ..]), d_o.slice(s![i0..i1, ..]));
        for j0 in (0..kend).step_by(KB) {
            let j1 = (j0 + KB).min(kend);
            let (kj, vj) = (k.slice(s![j0..j1, ..]), v.slice(s![j0..j1, ..]));
            let mut p = pb.slice_mut(s![..rows, ..j1 - j0]);
            let mut ds = db.slice_mut(s![..rows, ..j1 - j0]);
            scores(bl.scale, qi, kj, &mut p);
            for (r, mut row) in p.outer_iter_mut().enumerate() {
                let (i, live) = (i0 + r, bl.live(i0 + r, j0, j1));
                for (j, x) in row.iter_mut().enumerate() {
                    *x = if j < live && lse[i] != ninf {
                        (*x - lse[i]).exp()
                    } else {
                        zero
                    };
                }
            }
            general_mat_mul(one, &p.t(), &doi, one, &mut dv.slice_mut(s![j0..j1, ..]));
            // dS = P (dO v^T - dsum) scale.
            scores(one, doi, vj, &mut ds);
            for (r, (mut dr, pr)) in ds.outer_iter_mut().zip(p.outer_iter()).enumerate() {
                let c = dsum[i0 + r];
                dr.iter_mut()
                    .zip(pr.iter())
                    .for_each(|(d, &pv)| *d = pv * (*d - c) * bl.scale);
            }
            general_mat_mul(one, &ds, &kj, one, &mut dq.slice_mut(s![i0..i1, ..]));
            general_mat_mul(one, &ds.t(), &qi, one, &mut dk.slice_mut(s![j0..j1, ..]));
        }
    }
    [dq, dk, dv]
}

/// `f` of every (batch, head) pair index, in order; in parallel when `work` is large.
fn over_pairs<R: Send>(n: usize, work: usize, f: impl Fn(usize) -> R + Sync + Send) -> Vec<R> {
    if work >= PAR_THRESHOLD {
        (0..n).into_par_iter().map(f).collect()
    } else {
        (0..n).map(f).collect()
    }
}

fn four<'a, F>(op: &'static str, a: &'a ArrayD<F>) -> Result<ArrayView4<'a, F>> {
    a.view()
        .into_dimensionality::<Ix4>()
        .map_err(|e| kernel_err(op, format!("piece {:?} is not 4-d: {e}", a.shape())))
}

/// The `[n, d]` matrix of pair (b, h) of a `[B, n, H, d]` piece (or of key/value head h of
/// a `[B, n, G, d]` one).
fn pair<'a, F>(a: &ArrayView4<'a, F>, b: usize, h: usize) -> ArrayView2<'a, F> {
    (*a).slice_move(s![b, .., h, ..])
}

/// The sizes of q, k, v, checked against each other.
fn dims_of<F>(op: &'static str, x: [&ArrayD<F>; 3], causal: bool) -> Result<FlashDims> {
    FlashDims::of(x[0].shape(), x[1].shape(), x[2].shape(), causal).ok_or_else(|| {
        kernel_err(
            op,
            format!(
                "q {:?}, k {:?}, v {:?} are not [B, T, H, D], [B, S, G, D], [B, S, G, Dv] with H \
                 a multiple of G",
                x[0].shape(),
                x[1].shape(),
                x[2].shape()
            ),
        )
    })
}

fn shape_is<F>(op: &'static str, what: &str, a: &ArrayD<F>, want: &[usize]) -> Result<()> {
    if a.shape() == want {
        Ok(())
    } else {
        Err(kernel_err(
            op,
            format!("{what} is {:?}, want {want:?}", a.shape()),
        ))
    }
}

fn forward_t<F: FloatElement>(
    x: [&ArrayD<F>; 3],
    a: FlashAttrs,
    o: &mut ArrayD<F>,
    lse: &mut ArrayD<F>,
) -> Result<()> {
    let op = "flash_attention";
    let d = dims_of(op, x, a.causal)?;
    shape_is(op, "the o buffer", o, &d.o())?;
    shape_is(op, "the lse buffer", lse, &d.lse())?;
    let (q, k, v) = (four(op, x[0])?, four(op, x[1])?, four(op, x[2])?);
    let bl = Blocks {
        t: d.t,
        s: d.s,
        causal: a.causal,
        scale: F::from_f64(a.scale),
    };
    let work = d.b * d.h * d.t * d.s * (d.d + d.dv);
    let group = d.group();
    let out = over_pairs(d.b * d.h, work, |p| {
        let (b, h) = (p / d.h, p % d.h);
        let j = h / group;
        forward_pair((pair(&q, b, h), pair(&k, b, j), pair(&v, b, j)), bl)
    });
    let mut o4 = o
        .view_mut()
        .into_dimensionality::<Ix4>()
        .map_err(|e| kernel_err(op, e.to_string()))?;
    let mut l3 = lse.view_mut();
    for (p, (op_, lp)) in out.into_iter().enumerate() {
        let (b, h) = (p / d.h, p % d.h);
        o4.slice_mut(s![b, .., h, ..]).assign(&op_);
        for (i, x) in lp.into_iter().enumerate() {
            l3[[b, h, i]] = x;
        }
    }
    Ok(())
}

fn backward_t<F: FloatElement>(
    x: [&ArrayD<F>; 6],
    a: FlashAttrs,
    out: &mut [CpuArray],
) -> Result<()> {
    let op = "flash_attention_backward";
    let d = dims_of(op, [x[0], x[1], x[2]], a.causal)?;
    shape_is(op, "o", x[3], &d.o())?;
    shape_is(op, "the gradient of o", x[4], &d.o())?;
    shape_is(op, "lse", x[5], &d.lse())?;
    let [q, k, v, o, d_o] = [x[0], x[1], x[2], x[3], x[4]].map(|t| four(op, t));
    let (q, k, v, o, d_o) = (q?, k?, v?, o?, d_o?);
    let lse = x[5].as_standard_layout();
    let lse = lse
        .as_slice()
        .ok_or_else(|| kernel_err(op, "lse is not contiguous".into()))?;
    let bl = Blocks {
        t: d.t,
        s: d.s,
        causal: a.causal,
        scale: F::from_f64(a.scale),
    };
    let work = 2 * d.b * d.h * d.t * d.s * (d.d + d.dv);
    let group = d.group();
    let grads = over_pairs(d.b * d.h, work, |p| {
        let (b, h) = (p / d.h, p % d.h);
        let (j, rows) = (h / group, &lse[p * d.t..(p + 1) * d.t]);
        backward_pair(
            (pair(&q, b, h), pair(&k, b, j), pair(&v, b, j)),
            (pair(&o, b, h), pair(&d_o, b, h)),
            rows,
            bl,
        )
    });
    let [dq, dk, dv] = out else {
        return Err(kernel_err(
            op,
            format!("expects 3 output buffers, got {}", out.len()),
        ));
    };
    let mut outs = Vec::with_capacity(3);
    for (buf, want) in [(dq, x[0]), (dk, x[1]), (dv, x[2])] {
        let arr = F::view_mut(buf)
            .ok_or_else(|| kernel_err(op, format!("output buffer is not {}", F::DTYPE)))?;
        shape_is(op, "a gradient buffer", arr, want.shape())?;
        outs.push(
            arr.view_mut()
                .into_dimensionality::<Ix4>()
                .map_err(|e| kernel_err(op, e.to_string()))?,
        );
    }
    let [oq, ok, ov] = &mut outs[..] else {
        return Err(kernel_err(op, "expects 3 gradient views".into()));
    };
    // A key/value head's dk and dv: the sum of its group's query heads', in head order.
    for (p, [dq, dk, dv]) in grads.into_iter().enumerate() {
        let (b, h) = (p / d.h, p % d.h);
        oq.slice_mut(s![b, .., h, ..]).assign(&dq);
        let j = h / group;
        if h % group == 0 {
            ok.slice_mut(s![b, .., j, ..]).assign(&dk);
            ov.slice_mut(s![b, .., j, ..]).assign(&dv);
        } else {
            ok.slice_mut(s![b, .., j, ..])
                .zip_mut_with(&dk, |a, &x| *a += x);
            ov.slice_mut(s![b, .., j, ..])
                .zip_mut_with(&dv, |a, &x| *a += x);
        }
    }
    Ok(())
}

/// Every piece of `x` as an array of `F`, or None.
fn all<'a, F: TensorElement>(x: &[&'a CpuArray]) -> Option<Vec<&'a ArrayD<F>>> {
    x.iter().map(|a| F::view(a)).collect()
}

fn dtype_err(op: &'static str, x: &[&CpuArray], outputs: usize, want: usize) -> TensorError {
    kernel_err(
        op,
        format!(
            "needs f32 or f64 pieces of one dtype and {want} output buffers, got {:?} and {outputs}",
            x.iter().map(|a| a.dtype()).collect::<Vec<_>>()
        ),
    )
}

/// A pass typed by its float element: None when a piece is not of that type.
type Typed = fn(&[&CpuArray], FlashAttrs, &mut [CpuArray]) -> Option<Result<()>>;

/// The pass of `op` for f32 or f64 pieces (by the first input; 16-bit ones through f32) with
/// attributes `a` into its `outputs` buffers, or the typed error naming the pieces' dtypes.
fn by_float(
    op: &'static str,
    io: KernelIo<'_, CpuBackend>,
    (a, outputs): (FlashAttrs, usize),
    [wide, double]: [Typed; 2],
) -> Result<()> {
    through_wide(io.inputs, io.outputs, |x, out| {
        match x.first() {
            Some(CpuArray::F32(_)) => wide(x, a, out),
            Some(CpuArray::F64(_)) => double(x, a, out),
            _ => None,
        }
        .unwrap_or_else(|| Err(dtype_err(op, x, out.len(), outputs)))
    })
}

/// o and lse of q, k, v (16-bit operands through f32).
pub(super) fn forward(
    op: &FlashAttention,
    _b: &CpuBackend,
    io: KernelIo<'_, CpuBackend>,
) -> Result<()> {
    fn run<F: FloatElement>(
        x: &[&CpuArray],
        a: FlashAttrs,
        out: &mut [CpuArray],
    ) -> Option<Result<()>> {
        let v = all::<F>(x)?;
        let [o, lse] = out else {
            return None;
        };
        let (o, lse) = (F::view_mut(o)?, F::view_mut(lse)?);
        Some(forward_t([v[0], v[1], v[2]], a, o, lse))
    }
    by_float("flash_attention", io, (op.0, 2), [run::<f32>, run::<f64>])
}

/// dq, dk, dv from q, k, v, o, dO and lse (16-bit operands through f32).
pub(super) fn backward(
    op: &FlashAttentionGrad,
    _b: &CpuBackend,
    io: KernelIo<'_, CpuBackend>,
) -> Result<()> {
    fn run<F: FloatElement>(
        x: &[&CpuArray],
        a: FlashAttrs,
        out: &mut [CpuArray],
    ) -> Option<Result<()>> {
        let v = all::<F>(x)?;
        let [q, k, v_, o, d_o, lse] = v[..] else {
            return None;
        };
        Some(backward_t([q, k, v_, o, d_o, lse], a, out))
    }
    by_float(
        "flash_attention_backward",
        io,
        (op.0, 3),
        [run::<f32>, run::<f64>],
    )
}
