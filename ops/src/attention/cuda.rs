//! Fused attention CUDA kernels, written into the executor's output pieces. bf16 and f16 with
//! S == T, Dv == D <= 256 run cuDNN's flash engines (`cuda::attention`, which falls back to the
//! NVRTC flash kernels, logged, when cuDNN is missing or refuses) on `[B, H, T, D]` views of the
//! `[B, T, H, D]` pieces, with no copies. Everything else (f32, f64, and the 16-bit shapes those
//! engines do not take, through f32 copies) runs the composed path: per batch entry, the scores
//! of all heads by one strided-batched cuBLAS product reading the pieces in place, a row kernel
//! turning them into probabilities and the log-sum-exp (backward: probabilities from lse and
//! the scores' gradient), and the products with v (backward: with dO, k, q). The scores are
//! scratch from the runtime's allocator, one batch entry at a time, never kept.
//!
//! Grouped-query heads (k, v `[B, S, G, D]` for q's H = group x G heads) run both paths on
//! transient `[B, S, H, D]` copies of k and v (each head written `group` times, one strided
//! copy each), freed when the call returns: nothing saved for the backward holds them. The
//! backward's dK and dV come out per query head in scratch and sum over each group (one
//! column-sum launch each).

use crate::kernel_io::expect;
use crate::kernel_io::io_arrays;
use oxiflow_cuda::kernel_layer::{
    attention_backward, attention_forward, copy_nd, fill, gemm_at, grid, per_row,
    prepare_attention_backward, AttentionBackward, AttentionForward, AttentionShape, Bhtd,
    FloatType, Gemm, Operand, Template,
};
use oxiflow_cuda::{device_error as derr, launch, CudaKernels, CudaStorage};
use oxiflow_dtype::DType;
use oxiflow_sbp::Shape;
use oxiflow_tensor::{KernelBackend, KernelIo, OutSpec, Result};

use super::{FlashAttention, FlashAttentionGrad, FlashAttrs, FlashDims};

/// The operands of the backward kernel.
#[derive(Clone, Copy)]
struct GradInputs<'a> {
    q: &'a CudaStorage,
    k: &'a CudaStorage,
    v: &'a CudaStorage,
    o: &'a CudaStorage,
    d_o: &'a CudaStorage,
    lse: &'a CudaStorage,
}

const FWD: &str = "flash_attention";
const BWD: &str = "flash_attention_backward";

/// The cuDNN (or flash fallback) problem of a call of `dt` data it can serve.
fn fused_shape(d: &FlashDims, a: FlashAttrs, dt: DType) -> Option<AttentionShape> {
    let dtype = match dt {
        DType::BF16 => FloatType::Bf16,
        DType::F16 => FloatType::F16,
        _ => return None,
    };
    (d.s == d.t && d.dv == d.d && d.d <= 256).then_some(AttentionShape {
        batch: d.b,
        heads: d.h,
        seq: d.t,
        head_dim: d.d,
        causal: a.causal,
        scale: a.scale as f32,
        dtype,
    })
}

/// Whether the fused backward is deterministic: as torch's SDPA, it is not (dQ accumulates
/// through atomics: faster, not bitwise reproducible).
const DETERMINISTIC_BACKWARD: bool = false;

/// The fused backward of forward `f` as `flash_attention_backward` will call it: every gradient
/// laid out as its value (`bthd` of a buffer of its shape), the forward's addresses standing in
/// for the gradients' (a plan reads only the layout).
fn expected_backward(f: &AttentionForward) -> AttentionBackward {
    AttentionBackward {
        shape: f.shape,
        q: f.q,
        k: f.k,
        v: f.v,
        o: f.o,
        d_o: f.o,
        lse: f.lse,
        dq: f.q,
        dk: f.k,
        dv: f.v,
        deterministic: DETERMINISTIC_BACKWARD,
    }
}

/// The sizes of q, k, v (one float dtype, shapes fitting each other).
fn dims(op: &'static str, x: [&CudaStorage; 3], causal: bool) -> Result<FlashDims> {
    let dt = x[0].dtype();
    let d = FlashDims::of(
        x[0].shape().dims(),
        x[1].shape().dims(),
        x[2].shape().dims(),
        causal,
    );
    match d {
        Some(d) if dt.is_float() && x.iter().all(|p| p.dtype() == dt) => Ok(d),
        _ => {
            Err(derr(
                op,
                format!(
                "q {} {}, k {} {}, v {} {} are not [B, T, H, D], [B, S, G, D], [B, S, G, Dv] of \
                 one float dtype with H a multiple of G",
                x[0].dtype(), x[0].shape(), x[1].dtype(), x[1].shape(), x[2].dtype(), x[2].shape()
            ),
            ))
        }
    }
}

/// `[B, T, H, D]` piece `p` seen as `[B, H, T, D]`.
fn bthd(p: &CudaStorage) -> Bhtd {
    let [_, t, h, d] = dims4(p);
    Bhtd::bthd(p.ptr(), t, h, d)
}

/// The row kernels' arguments (rows, T, S, scale, causal) of one batch entry's `[H, T, S]`
/// scores.
fn row_args(h: usize, t: usize, s: usize, a: FlashAttrs) -> (i64, i64, i64, f64, i32) {
    ((h * t) as i64, t as i64, s as i64, a.scale, a.causal as i32)
}

/// `piece` from element `offset` on, rows `ld` apart.
fn at(piece: &CudaStorage, offset: usize, ld: usize) -> Operand<'_> {
    Operand { piece, offset, ld }
}

fn dims4(p: &CudaStorage) -> [usize; 4] {
    match *p.shape().dims() {
        [b, t, h, d] => [b, t, h, d],
        _ => [0; 4],
    }
}

/// `x` `[B, S, G, E]` with each head written `group` times in place: a scratch
/// `[B, S, G group, E]` whose head `j` is head `j / group` of `x`.
fn repeat_heads(
    cu: &CudaKernels,
    op: &'static str,
    x: &CudaStorage,
    group: usize,
) -> Result<CudaStorage> {
    let [b, s, g, e] = dims4(x);
    let out = cu.alloc(&OutSpec {
        shape: Shape::new([b, s, g * group, e]),
        dtype: x.dtype(),
    })?;
    let (ge, e64) = ((group * e) as i64, e as i64);
    copy_nd(
        cu.runtime(),
        op,
        x.dtype(),
        &[b * s * g, group, e],
        x.ptr(),
        0,
        &[e64, 0, 1],
        out.ptr(),
        0,
        &[ge, e64, 1],
        0,
    )?;
    Ok(out)
}

/// `grad` `[B, S, G group, E]` (per query head) summed over each group of `group` heads
/// into `out` `[B, S, G, E]`.
fn sum_groups(
    cu: &CudaKernels,
    op: &'static str,
    grad: &CudaStorage,
    group: usize,
    out: &CudaStorage,
) -> Result<()> {
    let [_, _, _, e] = dims4(out);
    let groups = out.numel() / e.max(1);
    let (rows, cols) = ((groups * group) as i64, e as i64);
    let (chunk, scale) = (group as i64, 1.0f64);
    let (rt, name) = (cu.runtime(), Template::ReduceCols.at(grad.dtype()));
    let (xp, yp) = (grad.ptr(), out.ptr());
    launch!(rt, op, name, grid(groups * e); rows, cols, chunk, scale, xp, yp)
}

/// A scratch `[H, T, S]` array of `dtype` for one batch entry's scores.
fn scores(cu: &CudaKernels, d: &FlashDims, dtype: DType) -> Result<CudaStorage> {
    cu.alloc(&OutSpec {
        shape: Shape::new([d.h, d.t, d.s]),
        dtype,
    })
}

/// The composed forward (see the module docs) of f32 or f64 q, k, v into o and lse.
fn composed_forward(
    cu: &CudaKernels,
    d: &FlashDims,
    a: FlashAttrs,
    [q, k, v]: [&CudaStorage; 3],
    o: &CudaStorage,
    lse: &CudaStorage,
) -> Result<()> {
    let (rt, dt) = (cu.runtime(), q.dtype());
    let (t, s, h, hd, hv) = (d.t, d.s, d.h, d.h * d.d, d.h * d.dv);
    let ls = lse.dtype().size() as u64;
    for b in 0..d.b {
        let (qo, ko, vo, oo) = (b * t * hd, b * s * hd, b * s * hv, b * t * hv);
        let p = scores(cu, d, dt)?;
        // scores[h] = q[b, :, h] k[b, :, h]^T, [T, S] per head.
        let g = Gemm {
            batch: h,
            m: t,
            k: d.d,
            n: s,
            ta: false,
            tb: true,
            strides: (d.d as i64, d.d as i64, (t * s) as i64),
            precision: a.precision,
        };
        gemm_at(rt, FWD, at(q, qo, hd), at(k, ko, hd), at(&p, 0, s), g)?;
        let (rows, tt, ss, sc, c) = row_args(h, t, s, a);
        let (xp, lp) = (p.ptr(), lse.ptr() + (b * h * t) as u64 * ls);
        launch!(rt, FWD, Template::FlashRows.at(dt), per_row(h * t); rows, tt, ss, sc, c, xp, lp)?;
        // o[b, :, h] = P[h] v[b, :, h].
        let g = Gemm {
            batch: h,
            m: t,
            k: s,
            n: d.dv,
            ta: false,
            tb: false,
            strides: ((t * s) as i64, d.dv as i64, d.dv as i64),
            precision: a.precision,
        };
        gemm_at(rt, FWD, at(&p, 0, s), at(v, vo, hv), at(o, oo, hv), g)?;
    }
    Ok(())
}

/// The composed backward of f32 or f64 operands into dq, dk, dv.
fn composed_backward(
    cu: &CudaKernels,
    d: &FlashDims,
    a: FlashAttrs,
    [q, k, v, d_o, lse]: [&CudaStorage; 5],
    [dq, dk, dv]: [&CudaStorage; 3],
) -> Result<()> {
    let (rt, dt) = (cu.runtime(), q.dtype());
    let (t, s, h, hd, hv) = (d.t, d.s, d.h, d.h * d.d, d.h * d.dv);
    let ls = lse.dtype().size() as u64;
    let (ts, dd, dvv) = ((t * s) as i64, d.d as i64, d.dv as i64);
    for b in 0..d.b {
        let (qo, ko, vo, oo) = (b * t * hd, b * s * hd, b * s * hv, b * t * hv);
        let (p, ds) = (scores(cu, d, dt)?, scores(cu, d, dt)?);
        let g = |m, k, n, ta, tb, strides| Gemm {
            batch: h,
            m,
            k,
            n,
            ta,
            tb,
            strides,
            precision: a.precision,
        };
        // Scores q k^T, and dP = dO v^T.
        let scores = g(t, d.d, s, false, true, (dd, dd, ts));
        gemm_at(rt, BWD, at(q, qo, hd), at(k, ko, hd), at(&p, 0, s), scores)?;
        let dp = g(t, d.dv, s, false, true, (dvv, dvv, ts));
        gemm_at(rt, BWD, at(d_o, oo, hv), at(v, vo, hv), at(&ds, 0, s), dp)?;
        // P = exp(scale scores - lse) (masked 0); dS = P (dP - rowsum(P dP)) scale.
        let (rows, tt, ss, sc, c) = row_args(h, t, s, a);
        let (xp, gp, lp) = (p.ptr(), ds.ptr(), lse.ptr() + (b * h * t) as u64 * ls);
        launch!(rt, BWD, Template::FlashRowsBw.at(dt), per_row(h * t); rows, tt, ss, sc, c, xp, gp, lp)?;
        // dv = P^T dO, dq = dS k, dk = dS^T q.
        for (x, y, out, geometry) in [
            (
                &p,
                at(d_o, oo, hv),
                at(dv, vo, hv),
                g(s, t, d.dv, true, false, (ts, dvv, dvv)),
            ),
            (
                &ds,
                at(k, ko, hd),
                at(dq, qo, hd),
                g(t, s, d.d, false, false, (ts, dd, dd)),
            ),
            (
                &ds,
                at(q, qo, hd),
                at(dk, ko, hd),
                g(s, t, d.d, true, false, (ts, dd, dd)),
            ),
        ] {
            gemm_at(rt, BWD, at(x, 0, s), y, out, geometry)?;
        }
    }
    Ok(())
}

/// o and lse of q, k, v into the executor's buffers.
pub(super) fn forward(
    op: &FlashAttention,
    cu: &CudaKernels,
    io: KernelIo<'_, CudaKernels>,
) -> Result<()> {
    let a = op.0;
    let ([q, k, v], [o, lse]) = io_arrays(FWD, io.inputs, io.outputs)?;
    let d = dims(FWD, [q, k, v], a.causal)?;
    expect(FWD, "the o buffer", o, &d.o(), q.dtype())?;
    expect(FWD, "the lse buffer", lse, &d.lse(), q.dtype().compute())?;
    if d.b * d.h * d.t == 0 {
        return Ok(());
    }
    if d.g != d.h && d.s > 0 {
        let group = d.group();
        let (k, v) = (
            repeat_heads(cu, FWD, k, group)?,
            repeat_heads(cu, FWD, v, group)?,
        );
        return heads_forward(cu, &FlashDims { g: d.h, ..d }, a, [q, &k, &v], o, lse);
    }
    heads_forward(cu, &d, a, [q, k, v], o, lse)
}

/// dq, dk, dv from q, k, v, o, dO and lse into the executor's buffers.
pub(super) fn backward(
    op: &FlashAttentionGrad,
    cu: &CudaKernels,
    io: KernelIo<'_, CudaKernels>,
) -> Result<()> {
    let a = op.0;
    let ([q, k, v, o, d_o, lse], out) = io_arrays::<_, _, 6, 3>(BWD, io.inputs, io.outputs)?;
    let x = GradInputs {
        q,
        k,
        v,
        o,
        d_o,
        lse,
    };
    let d = dims(BWD, [x.q, x.k, x.v], a.causal)?;
    let dt = x.q.dtype();
    expect(BWD, "o", x.o, &d.o(), dt)?;
    expect(BWD, "the gradient of o", x.d_o, &d.o(), dt)?;
    expect(BWD, "lse", x.lse, &d.lse(), dt.compute())?;
    let [dq, dk, dv] = out;
    expect(BWD, "the dq buffer", dq, x.q.shape().dims(), dt)?;
    expect(BWD, "the dk buffer", dk, x.k.shape().dims(), dt)?;
    expect(BWD, "the dv buffer", dv, x.v.shape().dims(), dt)?;
    if d.g == d.h || d.b * d.h * d.t * d.s == 0 {
        return heads_backward(cu, &d, a, x, [&*dq, &*dk, &*dv]);
    }
    let group = d.group();
    let (k, v) = (
        repeat_heads(cu, BWD, x.k, group)?,
        repeat_heads(cu, BWD, x.v, group)?,
    );
    let spec = |p: &CudaStorage| OutSpec {
        shape: p.shape().clone(),
        dtype: dt,
    };
    let (gk, gv) = (cu.alloc(&spec(&k))?, cu.alloc(&spec(&v))?);
    let wide = GradInputs { k: &k, v: &v, ..x };
    heads_backward(cu, &FlashDims { g: d.h, ..d }, a, wide, [&*dq, &gk, &gv])?;
    sum_groups(cu, BWD, &gk, group, dk)?;
    sum_groups(cu, BWD, &gv, group, dv)
}

/// The forward of q, k, v with one key/value head per query head (sizes checked).
fn heads_forward(
    cu: &CudaKernels,
    d: &FlashDims,
    a: FlashAttrs,
    [q, k, v]: [&CudaStorage; 3],
    o: &CudaStorage,
    lse: &CudaStorage,
) -> Result<()> {
    if d.s == 0 {
        // No keys: every output row is empty of weight.
        fill(cu.runtime(), FWD, o.dtype(), o.ptr(), o.numel(), 0.0, 0)?;
        return fill(
            cu.runtime(),
            FWD,
            lse.dtype(),
            lse.ptr(),
            lse.numel(),
            f64::NEG_INFINITY,
            0,
        );
    }
    if let Some(shape) = fused_shape(d, a, q.dtype()) {
        let args = AttentionForward {
            shape,
            q: bthd(q),
            k: bthd(k),
            v: bthd(v),
            o: bthd(o),
            lse: lse.ptr(),
        };
        // The backward's plan starts building before the forward's, so the two overlap
        // (a backward cuDNN does not serve is not built).
        if oxiflow_tensor::is_grad_enabled() {
            prepare_attention_backward(cu.runtime(), &expected_backward(&args));
        }
        attention_forward(cu.runtime(), &args)?;
        return Ok(());
    }
    let [wq, wk, wv] = [q, k, v].map(|x| cu.widened(FWD, x));
    let wo = cu.wide_out(o)?;
    composed_forward(cu, d, a, [&wq?, &wk?, &wv?], &wo, lse)?;
    cu.narrow(FWD, &wo, o)
}

/// The backward with one key/value head per query head (sizes checked) into dq, dk, dv.
fn heads_backward(
    cu: &CudaKernels,
    d: &FlashDims,
    a: FlashAttrs,
    x: GradInputs<'_>,
    [dq, dk, dv]: [&CudaStorage; 3],
) -> Result<()> {
    let dt = x.q.dtype();
    if d.b * d.h == 0 {
        return Ok(());
    }
    if d.t == 0 || d.s == 0 {
        // No query meets a key: every gradient is zero.
        for g in [dq, dk, dv] {
            fill(cu.runtime(), BWD, g.dtype(), g.ptr(), g.numel(), 0.0, 0)?;
        }
        return Ok(());
    }
    if let Some(shape) = fused_shape(d, a, dt) {
        let args = AttentionBackward {
            shape,
            q: bthd(x.q),
            k: bthd(x.k),
            v: bthd(x.v),
            o: bthd(x.o),
            d_o: bthd(x.d_o),
            lse: x.lse.ptr(),
            dq: bthd(dq),
            dk: bthd(dk),
            dv: bthd(dv),
            deterministic: DETERMINISTIC_BACKWARD,
        };
        attention_backward(cu.runtime(), &args)?;
        return Ok(());
    }
    let [wq, wk, wv, wdo] = [x.q, x.k, x.v, x.d_o].map(|p| cu.widened(BWD, p));
    let [gq, gk, gv] = [dq, dk, dv].map(|g| cu.wide_out(g));
    let (gq, gk, gv) = (gq?, gk?, gv?);
    composed_backward(cu, d, a, [&wq?, &wk?, &wv?, &wdo?, x.lse], [&gq, &gk, &gv])?;
    cu.narrow(BWD, &gq, dq)?;
    cu.narrow(BWD, &gk, dk)?;
    cu.narrow(BWD, &gv, dv)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_expected_backward_has_the_backward_ops_layout() {
        let (t, h, d) = (1024, 12, 64);
        let at = |p: u64| Bhtd::bthd(p, t, h, d);
        let f = AttentionForward {
            shape: AttentionShape {
                batch: 8,
                heads: h,
                seq: t,
                head_dim: d,
                causal: true,
                scale: 0.125,
                dtype: FloatType::Bf16,
            },
            q: at(0),
            k: at(1 << 24),
            v: at(2 << 24),
            o: at(3 << 24),
            lse: 4 << 24,
        };
        let e = expected_backward(&f);
        // `flash_attention_backward` lays every operand out as `bthd` of its own buffer.
        for (got, buffer) in [
            (e.q, 0),
            (e.k, 1),
            (e.v, 2),
            (e.o, 3),
            (e.d_o, 5),
            (e.dq, 6),
            (e.dk, 7),
            (e.dv, 8),
        ] {
            assert_eq!(got.strides, at(buffer << 24).strides);
        }
        assert_eq!(e.shape, f.shape);
        assert_eq!(e.deterministic, DETERMINISTIC_BACKWARD);
    }
}
