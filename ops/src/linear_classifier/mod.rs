//! The classifier fused with the product that makes its logits (a fused linear
//! cross-entropy): (x `[N, C]`, w `[V, C]`, targets `[N]` i64) -> the sum over rows of
//! the cross-entropy of `x w^T` over its first `classes` columns, with both gradients of that
//! sum computed in the same op and saved for the backward: `dx = D w` and `dw = D^T x`, `D`
//! the logits' gradient `softmax - onehot` (0 in the padding columns). The backward only
//! scales them by the incoming gradient, which is one value for the whole sum (one op).
//!
//! Neither the logits nor their gradient outlive the op. On CUDA the rows run in chunks: each
//! chunk's logits are one product into a scratch buffer, the one-pass classifier turns them
//! into their gradient in place, and two products add the chunk's share to `dx` and to `dw`
//! (accumulated in f32), so the op holds one chunk of logits (at most
//! [`CHUNK_BYTES`] bytes) where an unfused head holds all `N V` logits and their gradient.
//! Elsewhere the op composes the same kernels over all rows at once.
//!
//! Rows split or whole, the table whole: the loss and `dw` of a row shard are partial sums.
//! Classes split over ranks (a vocabulary-parallel table) take the vocabulary-parallel
//! cross-entropy instead ([`linear_classifier_loss_sum`] chooses). Its products run at the
//! op's [`MatmulPrecision`].
//!
//! Two ops through the public op contract, [`LinearClassifier`] and [`LinearClassifierGrad`].
//! Kernels: CPU in f32 and f64 (composed; 16-bit through f32), CUDA in f32, bf16 and f16
//! (chunked) and f64 (composed); any other backend or dtype is `TensorError::NoKernel` on
//! every rank before anything runs.

mod cpu;
mod cuda;

use oxiflow_dtype::{DType, MatmulPrecision};
use oxiflow_sbp::{rules, RuleMode, Shape};

use oxiflow_tensor::backend::{meta_err, need_i64, norm_stats_dtype, scratch};
use oxiflow_tensor::{
    dispatch_multi, is_grad_enabled, BinaryOp, Extern, ExternOp, Grad, Inferred, KernelBackend,
    MetaError, MetaResult, OutSpec, Result, Saves, Sbp, Tensor,
};

use crate::classifier::classifier_loss_padded;
use crate::composing_backend::ComposingBackend;
use crate::dispatch_outputs::dispatch_first;
use crate::op_signature::{
    kernels_first_output_differentiable, kernels_without_gradient, op_signature,
};
use crate::operand_dtypes::{forward_backward_kernels, one_float_dtype, FLOATS_AND_IDS};

/// The fused linear cross-entropy over the first `classes` rows of the table (`classes` in
/// `1..=V`): (x `[N, C]`, w `[V, C]`, targets `[N]` i64) -> (loss `[]`, dx `[N, C]`, dw `[V,
/// C]`), the loss f32 for 16-bit and f32 data (f64 for f64), dx and dw in the data's dtype and
/// not differentiable.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct LinearClassifier {
    pub classes: usize,
    pub precision: MatmulPrecision,
}

/// Its backward: (dx, dw, dloss `[]`) -> (dx, dw) each times dloss (computed in the loss's
/// precision, rounded once).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct LinearClassifierGrad;

/// At most this many bytes of logits live at once in a chunked kernel.
pub const CHUNK_BYTES: usize = 512 << 20;

forward_backward_kernels!(kernels_for(FLOATS_AND_IDS));

impl ExternOp for LinearClassifier {
    op_signature!("linear_classifier", 3);
    fn attrs(&self, key: &mut Vec<u8>) {
        key.extend_from_slice(&(self.classes as u64).to_le_bytes());
        key.push(self.precision as u8);
    }
    fn infer(&self, s: &[&Shape], d: &[DType], mode: RuleMode) -> MetaResult<Inferred> {
        forward_rules(self.classes, s, d, mode)
    }
    // The forward's gradients are saved for the backward.
    kernels_first_output_differentiable!(FORWARD);
    fn saves(&self, needs: &[bool]) -> Saves {
        let need = |i: usize| needs.get(i).copied().unwrap_or(false);
        let either = need(0) || need(1);
        Saves::NOTHING
            .and_output_if(1, either)
            .and_output_if(2, either)
    }
    fn backward(&self, g: &Grad<'_>) -> Result<Vec<Option<Tensor>>> {
        let (need_x, need_w) = (g.need(0), g.need(1));
        if !need_x && !need_w {
            return Ok(vec![None, None, None]);
        }
        // Both are saved whenever either is wanted, so one op scales them; an unwanted one's
        // output is dropped.
        let ins = [g.output(1)?, g.output(2)?, g.dy()?];
        let op = Extern::new(LinearClassifierGrad);
        let mut out = dispatch_multi(op.into(), &ins)?.into_iter();
        let (dx, dw) = (out.next(), out.next());
        Ok(vec![dx.filter(|_| need_x), dw.filter(|_| need_w), None])
    }
}

impl ExternOp for LinearClassifierGrad {
    op_signature!("linear_classifier_backward", 3);
    fn infer(&self, s: &[&Shape], d: &[DType], mode: RuleMode) -> MetaResult<Inferred> {
        let dt = one_float_dtype(&d[..2])?;
        if d[2] != norm_stats_dtype(dt) || s[2].ndim() != 0 {
            return Err(MetaError::Shape(format!(
                "needs a 0-d {} dloss, got {} {}",
                norm_stats_dtype(dt),
                d[2],
                s[2]
            )));
        }
        let r = rules::linear_classifier_backward(s[0], s[1], mode);
        Ok(Inferred::outputs(r, &[dt, dt]))
    }
    kernels_without_gradient!(BACKWARD);
}

/// The forward's shape and dtype checks and its rules.
fn forward_rules(
    classes: usize,
    s: &[&Shape],
    d: &[DType],
    mode: RuleMode,
) -> MetaResult<Inferred> {
    let dt = one_float_dtype(&d[..2])?;
    need_i64(d[2], "targets")?;
    let (n, c, v) = match (s[0].dims(), s[1].dims(), s[2].dims()) {
        ([n, c], [v, wc], [tn]) if wc == c && tn == n => (*n, *c, *v),
        _ => {
            return Err(MetaError::Shape(format!(
                "needs x [N, C], table [V, C] and targets [N], got {}, {}, {}",
                s[0], s[1], s[2]
            )))
        }
    };
    if !(1..=v).contains(&classes) {
        return Err(MetaError::Shape(format!(
            "classes {classes} must be in 1..={v} (the table's rows)"
        )));
    }
    let r = rules::linear_classifier(n, c, v, mode);
    Ok(Inferred::outputs(r, &[norm_stats_dtype(dt), dt, dt]))
}

/// A backend's fused classifier kernel (logits, targets, classes) -> [loss, dlogits].
pub(crate) type Classify<B> = fn(
    &B,
    &<B as KernelBackend>::Piece,
    &<B as KernelBackend>::Piece,
    usize,
    [&mut <B as KernelBackend>::Out; 2],
) -> Result<()>;

/// The fused linear cross-entropy's kernels composed of core kernels, on any backend.
pub(crate) struct Composed;

impl Composed {
    /// The backward composed of broadcasting products (dloss viewed as `[1, 1]`).
    pub(crate) fn backward<B: ComposingBackend>(
        b: &B,
        saved: [&B::Piece; 2],
        dloss: &B::Piece,
        out: [&mut B::Out; 2],
    ) -> Result<()> {
        let spec = b.out_spec(dloss);
        let d = b.reshaped(
            dloss,
            &OutSpec {
                shape: Shape::new([1, 1]),
                ..spec
            },
        )?;
        for (x, y) in saved.into_iter().zip(out) {
            b.binary(BinaryOp::Mul, x, &d, y)?;
        }
        Ok(())
    }

    /// The op composed of the product, classifier, product and sum kernels over all rows (the
    /// CPU's kernel, and the device's for f64 data and calls its libraries refuse).
    pub(crate) fn forward<B: ComposingBackend>(
        b: &B,
        x: &B::Piece,
        w: &B::Piece,
        targets: &B::Piece,
        (classes, precision): (usize, MatmulPrecision),
        [loss, dx, dw]: [&mut B::Out; 3],
        classify: Classify<B>,
    ) -> Result<()> {
        let (xs, ws, ls) = (b.out_spec(dx), b.out_spec(dw), b.out_spec(loss));
        let (n, v) = (xs.shape.dim(0), ws.shape.dim(0));
        let logits = scratch(
            b,
            &OutSpec {
                shape: Shape::new([n, v]),
                dtype: xs.dtype,
            },
            |t| b.matmul_t(x, w, (false, true), false, precision, t),
        )?;
        let mut rows = b.alloc(&OutSpec {
            shape: Shape::new([n]),
            dtype: ls.dtype,
        })?;
        let mut d = b.alloc(&b.out_spec(&logits))?;
        if n > 0 {
            classify(b, &logits, targets, classes, [&mut rows, &mut d])?;
        }
        drop(logits);
        let (rows, d) = (b.finish(rows), b.finish(d));
        b.matmul_t(&d, w, (false, false), false, precision, dx)?;
        b.matmul_t(&d, x, (true, false), false, precision, dw)?;
        b.sum_to_shape(&rows, loss)
    }
}

/// The sum over rows of the cross-entropy of `x w^T` (x `[N, C]`, table `w` `[V, C]`) against
/// i64 targets `[N]` over the table's first `classes` rows, as one fused op
/// ([`LinearClassifier`]) that never keeps the logits; a table split on the classes takes the
/// vocabulary-parallel cross-entropy of the product, and a call without gradients the plain
/// product and classifier.
pub fn linear_classifier_loss_sum(
    x: &Tensor,
    w: &Tensor,
    targets: &Tensor,
    classes: usize,
) -> Result<Tensor> {
    linear_classifier_loss_sum_at(x, w, targets, classes, MatmulPrecision::F32)
}

/// [`linear_classifier_loss_sum`] with its products at `precision`.
pub fn linear_classifier_loss_sum_at(
    x: &Tensor,
    w: &Tensor,
    targets: &Tensor,
    classes: usize,
    precision: MatmulPrecision,
) -> Result<Tensor> {
    let op = LinearClassifier { classes, precision };
    // The fused op's checks first, so every path refuses bad input alike.
    let shapes = [x.shape(), w.shape(), targets.shape()];
    op.infer(
        &shapes,
        &[x.dtype(), w.dtype(), targets.dtype()],
        RuleMode::ShapesOnly,
    )
    .map_err(|e| meta_err(&Extern::new(op).into(), e, &[x, w, targets]))?;
    let wants_grad = is_grad_enabled() && (x.requires_grad() || w.requires_grad());
    // The fused op's layouts: rows split or whole, the table whole; others would box.
    let fused = wants_grad
        && !w.has_sbp_over_ranks(|s| s != Sbp::Broadcast)
        && !x.has_sbp_over_ranks(|s| s != Sbp::S(0) && s != Sbp::Broadcast);
    if !fused {
        let logits = x.matmul_t_at(w, (false, true), precision)?;
        return classifier_loss_padded(&logits, targets, classes)?.sum_all();
    }
    dispatch_first(op, &[x, w, targets])
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn infer_checks_shapes_classes_and_dtypes() {
        use DType::{BF16, F32, I64};
        let op = LinearClassifier {
            classes: 5,
            precision: MatmulPrecision::F32,
        };
        let (x, w, t) = (Shape::new([4, 3]), Shape::new([6, 3]), Shape::new([4]));
        let infers = |op: &LinearClassifier, s: [&Shape; 3], d: [DType; 3]| {
            op.infer(&s, &d, RuleMode::ShapesOnly).is_ok()
        };
        assert!(infers(&op, [&x, &w, &t], [F32, F32, I64]));
        let bad_c = Shape::new([6, 2]);
        assert!(!infers(&op, [&x, &bad_c, &t], [F32, F32, I64]));
        let wide = LinearClassifier {
            classes: 7,
            precision: MatmulPrecision::F32,
        };
        assert!(!infers(&wide, [&x, &w, &t], [F32, F32, I64]));
        assert!(!infers(&op, [&x, &w, &t], [F32, F32, F32]));
        assert!(!infers(&op, [&x, &w, &t], [F32, BF16, I64]));
    }
}
