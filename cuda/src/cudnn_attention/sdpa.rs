//! The SDPA graphs, as cuDNN's frontend composes them for its flash-attention engines.
//!
//! Forward: `S = Q K^T`, `S *= scale`, causal mask (`row >= col` by index generation, compare
//! and select against -inf), softmax with its statistic saved (`max`, `exp(S - max)`, `sum`,
//! `stats = max + log sum`, `P = exp / sum` in the I/O type), `O = P V`.
//!
//! Backward: `Dsum = rowsum(dO * O)` (kept in the workspace), `P = exp(mask(scale Q K^T) - stats)`,
//! `dV = P^T dO`, `dS = P (dO V^T - Dsum) scale`, `dK = dS^T Q`, `dQ = dS K` (through an f32
//! accumulator in the workspace unless deterministic).
//!
//! K (and V in the backward) enter transposed: their dims and strides swap the last two axes,
//! which is a view, not a copy. `Variant` lists the small differences between frontend versions
//! (index-generation precision, the data type of the transposed K view); the caller tries them
//! in turn until cuDNN accepts one.

use cudarc::cudnn::sys::{
    cudnnDataType_t as Dt, cudnnPointwiseMode_t as Pw, cudnnReduceTensorOp_t as Red,
};

use super::graph::{packed, Graph, T};
use crate::raw::{AttentionBackward, Bhtd, FResult, FloatType};

/// Unique ids of the bound tensors.
pub(super) mod uid {
    pub const Q: i64 = 1;
    pub const K: i64 = 2;
    pub const V: i64 = 3;
    pub const O: i64 = 4;
    pub const STATS: i64 = 5;
    pub const SCALE: i64 = 6;
    pub const NEG_INF: i64 = 7;
    pub const D_O: i64 = 8;
    pub const DQ: i64 = 9;
    pub const DK: i64 = 10;
    pub const DV: i64 = 11;
    pub const SOFTMAX_SUM: i64 = 12;
    pub const DQ_ACCUM: i64 = 13;
    pub const ONE: i64 = 14;
}

/// Graph spellings accepted by different cuDNN versions.
#[derive(Clone, Copy, Debug)]
pub(super) struct Variant {
    /// Index generation computed in INT32 (older frontends) rather than FLOAT.
    pub index_int32: bool,
    /// The transposed-back K of the dQ product typed as the I/O type rather than FLOAT.
    pub k_view_io: bool,
}

pub(super) const VARIANTS: [Variant; 3] = [
    Variant {
        index_int32: false,
        k_view_io: false,
    },
    Variant {
        index_int32: true,
        k_view_io: false,
    },
    Variant {
        index_int32: true,
        k_view_io: true,
    },
];

pub(super) fn io_type(t: FloatType) -> Dt {
    match t {
        FloatType::Bf16 => Dt::CUDNN_DATA_BFLOAT16,
        FloatType::F16 => Dt::CUDNN_DATA_HALF,
        FloatType::F32 => Dt::CUDNN_DATA_FLOAT,
    }
}

/// `[b, h, t, d]` dims and the view's strides.
fn dims_of(b: i64, h: i64, t: i64, d: i64) -> [i64; 4] {
    [b, h, t, d]
}

/// The view with its last two axes swapped (`[b, h, d, t]`).
fn transposed(dims: [i64; 4], v: &Bhtd) -> ([i64; 4], [i64; 4]) {
    let s = v.strides;
    (
        [dims[0], dims[1], dims[3], dims[2]],
        [s[0], s[1], s[3], s[2]],
    )
}

/// Sizes shared by both graphs.
pub(super) struct Sizes {
    pub b: i64,
    pub h: i64,
    pub t: i64,
    pub d: i64,
    pub io: Dt,
    pub causal: bool,
}

impl Sizes {
    fn scores(&self) -> [i64; 4] {
        [self.b, self.h, self.t, self.t]
    }
    fn rows(&self) -> [i64; 4] {
        [self.b, self.h, self.t, 1]
    }
}

/// `s` with the causal mask applied (keeps `row >= col`, else `neg_inf`).
fn causal_mask(g: &mut Graph, s: T, neg_inf: T, var: Variant) -> FResult<T> {
    let f = Dt::CUDNN_DATA_FLOAT;
    let prec = if var.index_int32 {
        Dt::CUDNN_DATA_INT32
    } else {
        f
    };
    let row = g.virt(s.dims, s.strides, Dt::CUDNN_DATA_INT32)?;
    g.pointwise(Pw::CUDNN_POINTWISE_GEN_INDEX, prec, &[s], row, Some(2))?;
    let col = g.virt(s.dims, s.strides, Dt::CUDNN_DATA_INT32)?;
    g.pointwise(Pw::CUDNN_POINTWISE_GEN_INDEX, prec, &[s], col, Some(3))?;
    let keep = g.virt(s.dims, s.strides, Dt::CUDNN_DATA_BOOLEAN)?;
    g.pointwise(
        Pw::CUDNN_POINTWISE_CMP_GE,
        Dt::CUDNN_DATA_BOOLEAN,
        &[row, col],
        keep,
        None,
    )?;
    let out = g.virt(s.dims, s.strides, f)?;
    g.pointwise(
        Pw::CUDNN_POINTWISE_BINARY_SELECT,
        f,
        &[s, neg_inf, keep],
        out,
        None,
    )?;
    Ok(out)
}

/// `scale Q K^T` as a virtual f32 `[b, h, t, t]` tensor.
fn scaled_scores(g: &mut Graph, z: &Sizes, q: T, kt: T, scale: T) -> FResult<T> {
    let f = Dt::CUDNN_DATA_FLOAT;
    let (sd, sp) = (z.scores(), packed(z.scores()));
    let s = g.virt(sd, sp, f)?;
    g.matmul(q, kt, s)?;
    let scaled = g.virt(sd, sp, f)?;
    g.pointwise(Pw::CUDNN_POINTWISE_MUL, f, &[s, scale], scaled, None)?;
    Ok(scaled)
}

/// The forward graph: binds Q, K, V, O, STATS, SCALE, NEG_INF.
pub(super) fn forward(
    g: &mut Graph,
    z: &Sizes,
    q: &Bhtd,
    k: &Bhtd,
    v: &Bhtd,
    o: &Bhtd,
    var: Variant,
) -> FResult<()> {
    let f = Dt::CUDNN_DATA_FLOAT;
    let dims = dims_of(z.b, z.h, z.t, z.d);
    let q = g.io(uid::Q, dims, q.strides, z.io)?;
    let (kd, ks) = transposed(dims, k);
    let kt = g.io(uid::K, kd, ks, z.io)?;
    let v = g.io(uid::V, dims, v.strides, z.io)?;
    let o = g.io(uid::O, dims, o.strides, z.io)?;
    let stats = g.io(uid::STATS, z.rows(), packed(z.rows()), f)?;
    let scale = g.scalar(uid::SCALE, f)?;
    let neg_inf = g.scalar(uid::NEG_INF, f)?;
    let (sd, sp) = (z.scores(), packed(z.scores()));
    let scaled = scaled_scores(g, z, q, kt, scale)?;
    let masked = if z.causal {
        causal_mask(g, scaled, neg_inf, var)?
    } else {
        scaled
    };
    let rp = packed(z.rows());
    let max = g.virt(z.rows(), rp, f)?;
    g.reduction(Red::CUDNN_REDUCE_TENSOR_MAX, masked, max)?;
    let sub = g.virt(sd, sp, f)?;
    g.pointwise(Pw::CUDNN_POINTWISE_SUB, f, &[masked, max], sub, None)?;
    let e = g.virt(sd, sp, f)?;
    g.pointwise(Pw::CUDNN_POINTWISE_EXP, f, &[sub], e, None)?;
    let sum = g.virt(z.rows(), rp, f)?;
    g.reduction(Red::CUDNN_REDUCE_TENSOR_ADD, e, sum)?;
    let log = g.virt(z.rows(), rp, f)?;
    g.pointwise(Pw::CUDNN_POINTWISE_LOG, f, &[sum], log, None)?;
    g.pointwise(Pw::CUDNN_POINTWISE_ADD, f, &[max, log], stats, None)?;
    let p = g.virt(sd, sp, z.io)?;
    g.pointwise(Pw::CUDNN_POINTWISE_DIV, f, &[e, sum], p, None)?;
    g.matmul(p, v, o)
}

/// Views of the backward's operands.
pub(super) struct BackwardViews<'a> {
    pub q: &'a Bhtd,
    pub k: &'a Bhtd,
    pub v: &'a Bhtd,
    pub o: &'a Bhtd,
    pub d_o: &'a Bhtd,
    pub dq: &'a Bhtd,
    pub dk: &'a Bhtd,
    pub dv: &'a Bhtd,
}

impl<'a> BackwardViews<'a> {
    /// The views of backward call `a`.
    pub(super) fn of(a: &'a AttentionBackward) -> BackwardViews<'a> {
        BackwardViews {
            q: &a.q,
            k: &a.k,
            v: &a.v,
            o: &a.o,
            d_o: &a.d_o,
            dq: &a.dq,
            dk: &a.dk,
            dv: &a.dv,
        }
    }
}

/// The backward graph: binds Q, K, V, O, D_O, STATS, DQ, DK, DV, SCALE, NEG_INF, ONE,
/// SOFTMAX_SUM (f32 `[b, h, t]`) and, unless `deterministic`, DQ_ACCUM (f32 `[b, h, t, d]`).
pub(super) fn backward(
    g: &mut Graph,
    z: &Sizes,
    x: &BackwardViews<'_>,
    deterministic: bool,
    var: Variant,
) -> FResult<()> {
    let f = Dt::CUDNN_DATA_FLOAT;
    let dims = dims_of(z.b, z.h, z.t, z.d);
    let q = g.io(uid::Q, dims, x.q.strides, z.io)?;
    let (kd, ks) = transposed(dims, x.k);
    let kt = g.io(uid::K, kd, ks, z.io)?;
    let (vd, vs) = transposed(dims, x.v);
    let vt = g.io(uid::V, vd, vs, z.io)?;
    let o = g.io(uid::O, dims, x.o.strides, z.io)?;
    let d_o = g.io(uid::D_O, dims, x.d_o.strides, z.io)?;
    let rows = z.rows();
    let rp = packed(rows);
    let stats = g.io(uid::STATS, rows, rp, f)?;
    let dq = g.io(uid::DQ, dims, x.dq.strides, z.io)?;
    let dk = g.io(uid::DK, dims, x.dk.strides, z.io)?;
    let dv = g.io(uid::DV, dims, x.dv.strides, z.io)?;
    let scale = g.scalar(uid::SCALE, f)?;
    let neg_inf = g.scalar(uid::NEG_INF, f)?;
    let one = g.scalar(uid::ONE, f)?;

    // Dsum = rowsum(dO * O), written to the workspace.
    let prod = g.virt(dims, packed(dims), f)?;
    g.pointwise(Pw::CUDNN_POINTWISE_MUL, f, &[d_o, o], prod, None)?;
    let red = g.virt(rows, rp, f)?;
    g.reduction(Red::CUDNN_REDUCE_TENSOR_ADD, prod, red)?;
    let softmax_sum = g.io(uid::SOFTMAX_SUM, rows, rp, f)?;
    g.pointwise(Pw::CUDNN_POINTWISE_MUL, f, &[red, one], softmax_sum, None)?;

    // P = exp(mask(scale Q K^T) - stats).
    let (sd, sp) = (z.scores(), packed(z.scores()));
    let scaled = scaled_scores(g, z, q, kt, scale)?;
    let shifted = g.virt(sd, sp, f)?;
    g.pointwise(Pw::CUDNN_POINTWISE_SUB, f, &[scaled, stats], shifted, None)?;
    let masked = if z.causal {
        causal_mask(g, shifted, neg_inf, var)?
    } else {
        shifted
    };
    let p = g.virt(sd, sp, f)?;
    g.pointwise(Pw::CUDNN_POINTWISE_EXP, f, &[masked], p, None)?;

    // dV = P^T dO.
    let t_strides = [sp[0], sp[1], 1, z.t];
    let pt = g.virt(sd, t_strides, z.io)?;
    g.reshape(p, pt)?;
    g.matmul(pt, d_o, dv)?;

    // dS = P (dO V^T - Dsum) scale.
    let dp = g.virt(sd, sp, f)?;
    g.matmul(d_o, vt, dp)?;
    let dp2 = g.virt(sd, sp, f)?;
    g.pointwise(Pw::CUDNN_POINTWISE_SUB, f, &[dp, softmax_sum], dp2, None)?;
    let ds = g.virt(sd, sp, f)?;
    g.pointwise(Pw::CUDNN_POINTWISE_MUL, f, &[dp2, p], ds, None)?;
    let ds2 = g.virt(sd, sp, f)?;
    g.pointwise(Pw::CUDNN_POINTWISE_MUL, f, &[ds, scale], ds2, None)?;

    // dK = dS^T Q.
    let dst = g.virt(sd, t_strides, z.io)?;
    g.reshape(ds2, dst)?;
    g.matmul(dst, q, dk)?;

    // dQ = dS K.
    let k_dt = if var.k_view_io { z.io } else { f };
    let k = g.virt(dims, x.k.strides, k_dt)?;
    g.reshape(kt, k)?;
    if deterministic {
        g.matmul(ds2, k, dq)
    } else {
        let acc = g.io(uid::DQ_ACCUM, dims, packed(dims), f)?;
        g.matmul(ds2, k, acc)?;
        g.pointwise(Pw::CUDNN_POINTWISE_IDENTITY, f, &[acc], dq, None)
    }
}
