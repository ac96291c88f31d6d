//! Fused (flash) attention on the heads layout of a Linear's output: q `[B, T, H, D]`, k
//! `[B, S, G, D]`, v `[B, S, G, Dv]` with H a multiple of G (grouped-query attention: query
//! head `h` reads key/value head `h / (H / G)`; G == H is multi-head attention) give
//! `o = softmax(scale q k^T [+ causal mask]) v` `[B, T, H, Dv]` and the log-sum-exp of each
//! row of masked, scaled scores, `lse` `[B, H, T]` in the compute dtype (f32 for 16-bit
//! floats, else the input's), which the backward reads
//! instead of any `[T, S]` probabilities. No kernel keeps the scores: the CPU runs an
//! online softmax over key blocks, CUDA runs cuDNN's flash engines (or the composed path for
//! what they do not take, with the scores as transient scratch).
//!
//! Two ops through the public op contract: [`FlashAttention`] (q, k, v) -> (o, lse), `lse`
//! saved and not differentiable; [`FlashAttentionGrad`] (q, k, v, o, dO, lse) -> (dq, dk, dv),
//! linear in dO. Split on
//! batch (every tensor S(0)), on heads (q, k, v, o S(2), lse S(1)) or all broadcast; the
//! backward also takes a partial dO (its outputs then partial). A heads split of grouped heads
//! (G < H) must split the G key/value heads evenly, so every rank holds whole groups and its
//! query heads meet their own key/value heads; the backward's dK and dV sum over each group's
//! query heads. No P input to the forward: the softmax is not linear. Kernels: CPU in f32 and
//! f64 (16-bit through f32, `cpu.rs`), CUDA in f32, f64, bf16 and f16 (`cuda.rs`); any other
//! backend or dtype is `TensorError::NoKernel` on every rank before anything runs.

mod cpu;
mod cuda;

use oxiflow_dtype::{DType, MatmulPrecision};
use oxiflow_sbp::{rules, RuleMode, Sbp, Shape};
use oxiflow_tensor::{
    dispatch_multi, Extern, ExternOp, Grad, Inferred, MetaError, MetaResult, Result, Saves, Tensor,
    TensorError,
};

use crate::dispatch_outputs::dispatch_pair;
use crate::op_signature::{
    kernels_first_output_differentiable, kernels_without_gradient, op_signature,
};
use crate::operand_dtypes::{forward_backward_kernels, one_float_dtype, FLOATS};

/// The attributes of one attention call: with `causal` (needs S == T) query `i` attends to keys
/// `0..=i`; scores are `scale q . k`.
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct FlashAttrs {
    pub causal: bool,
    pub scale: f64,
    /// How the composed path's f32 products run on a device.
    pub precision: MatmulPrecision,
}

impl FlashAttrs {
    /// The attribute bytes: causal, the scale's bits, the precision.
    fn key(&self, key: &mut Vec<u8>) {
        key.push(u8::from(self.causal));
        key.extend_from_slice(&self.scale.to_bits().to_le_bytes());
        key.push(self.precision as u8);
    }
}

/// Fused attention's forward: (q, k, v) -> (o, lse).
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct FlashAttention(pub FlashAttrs);

/// Fused attention's backward: (q, k, v, o, dO, lse) -> (dq, dk, dv).
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct FlashAttentionGrad(pub FlashAttrs);

/// The sizes of one call: q `[b, t, h, d]`, k `[b, s, g, d]`, v `[b, s, g, dv]`.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct FlashDims {
    pub b: usize,
    pub t: usize,
    pub s: usize,
    pub h: usize,
    /// Key/value heads: h is a multiple of g (0 only when h is).
    pub g: usize,
    pub d: usize,
    pub dv: usize,
}

/// Whether h query heads share g key/value heads in whole groups.
fn groups_fit(h: usize, g: usize) -> bool {
    if g == 0 {
        h == 0
    } else {
        h.is_multiple_of(g)
    }
}

impl FlashDims {
    /// The sizes of q, k, v shapes when they fit each other (and S == T when `causal`): the
    /// kernels' check of what the op's inference let through.
    pub fn of(q: &[usize], k: &[usize], v: &[usize], causal: bool) -> Option<FlashDims> {
        let (&[b, t, h, d], &[_, s, g, _], &[_, _, _, dv]) = (q, k, v) else {
            return None;
        };
        let fits =
            k == [b, s, g, d] && v == [b, s, g, dv] && groups_fit(h, g) && (!causal || s == t);
        fits.then_some(FlashDims {
            b,
            t,
            s,
            h,
            g,
            d,
            dv,
        })
    }
    /// Query heads per key/value head (1 when there are none).
    pub fn group(&self) -> usize {
        self.h.checked_div(self.g).unwrap_or(1)
    }
    /// o's shape `[b, t, h, dv]`.
    pub fn o(&self) -> [usize; 4] {
        [self.b, self.t, self.h, self.dv]
    }
    /// lse's shape `[b, h, t]`.
    pub fn lse(&self) -> [usize; 3] {
        [self.b, self.h, self.t]
    }
}

fn shape_err(detail: String) -> MetaError {
    MetaError::Shape(detail)
}

/// Checks q `[B, T, H, D]`, k `[B, S, G, D]`, v `[B, S, G, Dv]` (H a multiple of G; S == T
/// when causal) and the scale; returns the sizes.
fn check_qkv(q: &Shape, k: &Shape, v: &Shape, a: FlashAttrs) -> MetaResult<FlashDims> {
    for (what, x, dims) in [
        ("q", q, "[B, T, H, D]"),
        ("k", k, "[B, S, G, D]"),
        ("v", v, "[B, S, G, Dv]"),
    ] {
        if x.ndim() != 4 {
            return Err(shape_err(format!("{what} must be 4-d {dims}, got {x}")));
        }
    }
    let (qd, kd, vd) = (q.dims(), k.dims(), v.dims());
    if (kd[0], kd[3]) != (qd[0], qd[3]) {
        return Err(shape_err(format!(
            "k must be [B, S, G, D] for q [B, T, H, D] (same B, D), got q {q} and k {k}"
        )));
    }
    if !groups_fit(qd[2], kd[2]) {
        return Err(shape_err(format!(
            "the {} query heads of q {q} must be a multiple of the {} key/value heads of k {k}",
            qd[2], kd[2]
        )));
    }
    if vd[..3] != kd[..3] {
        return Err(shape_err(format!(
            "v must be [B, S, G, Dv] for k [B, S, G, D] (same B, S, G), got k {k} and v {v}"
        )));
    }
    if a.causal && kd[1] != qd[1] {
        return Err(shape_err(format!(
            "causal attention needs as many keys as queries (S == T), got q {q} and k {k}"
        )));
    }
    if !a.scale.is_finite() {
        return Err(shape_err(format!(
            "scale must be finite, got {:?}",
            a.scale
        )));
    }
    if qd[3] == 0 || vd[3] == 0 {
        return Err(shape_err(format!(
            "head sizes must be positive, got q {q} and v {v}"
        )));
    }
    FlashDims::of(qd, kd, vd, a.causal)
        .ok_or_else(|| shape_err(format!("q {q}, k {k} and v {v} do not fit")))
}

/// The rules of a fused attention pass, for these ops and for ops outside the crate that
/// attend alike (context-parallel attention): every operand split as one of `layouts` (an
/// operand's SBP and beside it the statistics' SBP).
#[derive(Clone, Copy, Debug)]
pub struct AttentionRules<'a> {
    pub layouts: &'a [(Sbp, Sbp)],
    /// The dims of o `[B, T, H, Dv]` and of the statistics lse `[B, H, T]`.
    pub o: [usize; 4],
    pub lse: [usize; 3],
    /// The operands' dtype and the statistics' dtype.
    pub dtype: DType,
    pub stats: DType,
}

impl AttentionRules<'_> {
    /// The forward's rules: (q, k, v) -> (o, lse).
    pub fn forward(&self, mode: RuleMode) -> Inferred {
        self.forward_grouped(mode, None)
    }

    /// The forward's rules where k's heads (dim 2) are `groups` key/value heads shared by
    /// groups of query heads: only splits of whole groups.
    fn forward_grouped(&self, mode: RuleMode, groups: Option<usize>) -> Inferred {
        let (o, lse) = (Shape::new(self.o), Shape::new(self.lse));
        let r = rules::fused_attention(o, lse, self.layouts, mode);
        Inferred::outputs(whole_groups(r, groups), &[self.dtype, self.stats])
    }

    /// The backward's rules: (q, k, v, o, dO, lse) -> (dq, dk, dv), also partial through a
    /// partial dO; o, dO and lse must have the forward's output shapes, lse the stats dtype.
    pub fn backward(&self, s: &[&Shape], d: &[DType], mode: RuleMode) -> MetaResult<Inferred> {
        self.backward_grouped(s, d, mode, None)
    }

    /// [`AttentionRules::backward`] of grouped heads (see [`AttentionRules::forward_grouped`]).
    fn backward_grouped(
        &self,
        s: &[&Shape],
        d: &[DType],
        mode: RuleMode,
        groups: Option<usize>,
    ) -> MetaResult<Inferred> {
        let must_be = |what: &str, x: &Shape, want: &[usize]| {
            if x.dims() == want {
                Ok(())
            } else {
                Err(shape_err(format!("{what} must be {want:?}, got {x}")))
            }
        };
        must_be("o", s[3], &self.o)?;
        must_be("the gradient of o", s[4], &self.o)?;
        must_be("lse", s[5], &self.lse)?;
        let (dt, stats) = (self.dtype, self.stats);
        if d[5] != stats {
            return Err(MetaError::DType(format!(
                "lse must be {stats} for {dt} operands, got {}",
                d[5]
            )));
        }
        let r = rules::fused_attention_backward([s[0], s[1], s[2]], self.layouts, mode);
        Ok(Inferred::outputs(whole_groups(r, groups), &[dt, dt, dt]))
    }
}

/// `r` keeping only candidates that split k's heads (input 1, dim 2) into whole groups.
fn whole_groups(r: rules::Rules, groups: Option<usize>) -> rules::Rules {
    match groups {
        Some(g) => r.with_even_split(1, 2, g),
        None => r,
    }
}

/// The checked sizes and rules of a call with attributes `a` (both passes check q, k, v; the
/// backward's other operands are checked by [`AttentionRules::backward`]).
fn attention_rules(
    s: &[&Shape],
    d: &[DType],
    a: FlashAttrs,
) -> MetaResult<(AttentionRules<'static>, Option<usize>)> {
    let dt = one_float_dtype(&d[..d.len().min(5)])?;
    let dims = check_qkv(s[0], s[1], s[2], a)?;
    let rules = AttentionRules {
        layouts: &rules::HEAD_LAYOUTS,
        o: dims.o(),
        lse: dims.lse(),
        dtype: dt,
        stats: dt.compute(),
    };
    Ok((rules, (dims.g != dims.h).then_some(dims.g)))
}

forward_backward_kernels!(kernels_for(FLOATS));

impl ExternOp for FlashAttention {
    op_signature!("flash_attention", 3);
    fn attrs(&self, key: &mut Vec<u8>) {
        self.0.key(key)
    }
    fn infer(&self, s: &[&Shape], d: &[DType], mode: RuleMode) -> MetaResult<Inferred> {
        let (attention, groups) = attention_rules(s, d, self.0)?;
        Ok(attention.forward_grouped(mode, groups))
    }
    // The log-sum-exp is a statistic for the backward.
    kernels_first_output_differentiable!(FORWARD);
    fn saves(&self, _needs: &[bool]) -> Saves {
        // The backward recomputes each block of probabilities from q, k and lse; dO . o gives
        // each row's softmax correction.
        Saves::inputs(&[0, 1, 2]).and_outputs(&[0, 1])
    }
    fn backward(&self, g: &Grad<'_>) -> Result<Vec<Option<Tensor>>> {
        let Some(Some(d_o)) = g.dys().first() else {
            return Ok(vec![None, None, None]);
        };
        let (q, k, v) = (g.input(0)?, g.input(1)?, g.input(2)?);
        let (o, lse) = (g.output(0)?, g.output(1)?);
        let d_o = if d_o.dtype() == o.dtype() {
            d_o.clone()
        } else {
            d_o.cast(o.dtype())?
        };
        let op = Extern::new(FlashAttentionGrad(self.0));
        let grads = dispatch_multi(op.into(), &[q, k, v, o, &d_o, lse])?;
        Ok(grads
            .into_iter()
            .enumerate()
            .map(|(i, t)| g.need(i).then_some(t))
            .collect())
    }
}

impl ExternOp for FlashAttentionGrad {
    op_signature!("flash_attention_backward", 6);
    fn attrs(&self, key: &mut Vec<u8>) {
        self.0.key(key)
    }
    fn infer(&self, s: &[&Shape], d: &[DType], mode: RuleMode) -> MetaResult<Inferred> {
        let (attention, groups) = attention_rules(s, d, self.0)?;
        attention.backward_grouped(s, d, mode, groups)
    }
    kernels_without_gradient!(
        BACKWARD,
        "the attention backward has no gradient of its own (no double backward)"
    );
}

/// Fused attention on heads-last operands: queries `q` `[B, T, H, D]`, keys `k` `[B, S, G,
/// D]`, values `v` `[B, S, G, Dv]` (H a multiple of G: query head `h` reads key/value head `h
/// / (H / G)`) give `softmax(scale q k^T [+ causal mask]) v` `[B, T, H, Dv]` (with `causal`, S
/// == T and query `i` attends to keys `0..=i`). Never keeps a `[T, S]` array; the backward
/// recomputes the probabilities from the log-sum-exp.
pub fn flash_attention(
    q: &Tensor,
    k: &Tensor,
    v: &Tensor,
    causal: bool,
    scale: f64,
) -> Result<Tensor> {
    flash_attention_at(q, k, v, (causal, scale), MatmulPrecision::F32)
}

/// [`flash_attention`] with `(causal, scale)` and f32 products at `precision` on a device.
pub fn flash_attention_at(
    q: &Tensor,
    k: &Tensor,
    v: &Tensor,
    attrs: (bool, f64),
    precision: MatmulPrecision,
) -> Result<Tensor> {
    Ok(flash_attention_lse_at(q, k, v, attrs, precision)?.0)
}

/// Fused attention on heads-first operands: queries `q` `[B, H, T, D]`, keys `k` `[B, G, S,
/// D]`, values `v` `[B, G, S, Dv]` (grouped heads as above) give `softmax(scale q k^T [+
/// causal mask]) v` `[B, H, T, Dv]`: [`flash_attention`] on the operands permuted to `[B, T,
/// H, D]` (a batch or heads split moves with its dim). Never keeps a `[T, S]` array.
pub fn attention(q: &Tensor, k: &Tensor, v: &Tensor, causal: bool, scale: f64) -> Result<Tensor> {
    for (what, x) in [("q", q), ("k", k), ("v", v)] {
        if x.ndim() != 4 {
            return Err(TensorError::Shape {
                op: "attention",
                shapes: format!("{}, {}, {}", q.shape(), k.shape(), v.shape()),
                sbps: format!("{:?}, {:?}, {:?}", q.nd_sbp(), k.nd_sbp(), v.nd_sbp()),
                detail: format!("{what} must be 4-d [B, H, T, D], got {}", x.shape()),
            });
        }
    }
    let heads_last = |x: &Tensor| x.permute(&[0, 2, 1, 3]);
    flash_attention(
        &heads_last(q)?,
        &heads_last(k)?,
        &heads_last(v)?,
        causal,
        scale,
    )?
    .permute(&[0, 2, 1, 3])
}

/// [`flash_attention`] and the log-sum-exp of each row's masked, scaled scores `[B, H, T]` (f32
/// for 16-bit operands, else their dtype; -inf for a row without keys).
pub fn flash_attention_lse(
    q: &Tensor,
    k: &Tensor,
    v: &Tensor,
    causal: bool,
    scale: f64,
) -> Result<(Tensor, Tensor)> {
    flash_attention_lse_at(q, k, v, (causal, scale), MatmulPrecision::F32)
}

/// [`flash_attention_lse`] with `(causal, scale)` and f32 products at `precision` on a device.
pub fn flash_attention_lse_at(
    q: &Tensor,
    k: &Tensor,
    v: &Tensor,
    (causal, scale): (bool, f64),
    precision: MatmulPrecision,
) -> Result<(Tensor, Tensor)> {
    let attrs = FlashAttrs {
        causal,
        scale,
        precision,
    };
    dispatch_pair(FlashAttention(attrs), &[q, k, v])
}
