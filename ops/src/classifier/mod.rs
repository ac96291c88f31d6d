//! The fused classifier: per-row cross-entropy of logits `[N, V]` against i64 targets `[N]`,
//! computing the logits' gradient `softmax - onehot` in the same pass and saving it (in the
//! logits' dtype) for the backward, which only scales its rows by the incoming gradient: no
//! second softmax, and the logits themselves are not kept. The loss is f32 for f32 and 16-bit
//! logits (f64 for f64 ones). Only the first `classes` columns are classes: the columns from
//! `classes` on (a vocabulary padded to an aligned width) are outside the softmax and get a
//! zero gradient. Rows split or whole; a vocabulary split over several ranks takes the
//! vocabulary-parallel cross-entropy instead (see [`Tensor::cross_entropy_padded`]).
//!
//! Two ops through the public op contract, [`Classifier`] and [`ClassifierGrad`]. Kernels:
//! CPU in f32 and f64 (the cross-entropy kernels composed; 16-bit through f32), CUDA in f32,
//! bf16 and f16 (one fused pass) and f64 (composed); any other backend or dtype is
//! `TensorError::NoKernel` on every rank before anything runs.

mod cpu;
mod cuda;

pub(crate) use cuda::{cuda_classify, launch_classifier, launch_row_scale};

use oxiflow_dtype::DType;
use oxiflow_sbp::{rules, RuleMode, Shape};

use crate::composing_backend::ComposingBackend;
use crate::dispatch_outputs::dispatch_first;
use crate::op_signature::{
    kernels_first_output_differentiable, kernels_without_gradient, op_signature,
};
use crate::operand_dtypes::{forward_backward_kernels, FLOATS_AND_IDS};
use crate::operand_shapes::shapes_text;
use oxiflow_tensor::backend::{
    kernel_err, meta_err, need_float, need_i64, norm_stats_dtype, scratch,
};
use oxiflow_tensor::{
    dispatch, vocab_parallel_cross_entropy, BinaryOp, Extern, ExternOp, Grad, Inferred, MetaError,
    MetaResult, OutSpec, Result, Saves, Sbp, ScalarOp, Tensor, Triangle,
};

/// The fused classifier: (logits `[N, V]`, targets `[N]` i64) -> (loss `[N]`, dlogits `[N,
/// V]` = softmax - onehot over the first `classes` columns and 0 in the others, not
/// differentiable); `classes` in `1..=V` (`V`: every column is a class). A target outside
/// `0..classes` is a typed error on the CPU and gives its row NaN on a device (which cannot
/// raise an error without a sync).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Classifier {
    pub classes: usize,
}

/// The classifier's backward: (dlogits `[N, V]`, dloss `[N]`) -> dlogits with row i scaled by
/// dloss\[i\] (computed in the loss's precision, rounded once).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct ClassifierGrad;

fn bad_shapes(what: &str, s: &[&Shape]) -> MetaError {
    MetaError::Shape(format!("needs {what}, got {}", shapes_text(s)))
}

/// The logits' width V after checking logits `[N, V]` (a float dtype) beside per-row values
/// `[N]`.
fn logits_width(s: &[&Shape], d: &[DType]) -> MetaResult<usize> {
    need_float(d[0], "logits")?;
    match (s[0].dims(), s[1].dims()) {
        ([n, v], [rows]) if rows == n => Ok(*v),
        _ => Err(bad_shapes("logits [N, V] and per-row values [N]", s)),
    }
}

forward_backward_kernels!(kernels_for(FLOATS_AND_IDS));

impl ExternOp for Classifier {
    op_signature!("classifier", 2);
    fn attrs(&self, key: &mut Vec<u8>) {
        key.extend_from_slice(&(self.classes as u64).to_le_bytes());
    }
    fn infer(&self, s: &[&Shape], d: &[DType], mode: RuleMode) -> MetaResult<Inferred> {
        let v = logits_width(s, d)?;
        let classes = self.classes;
        if !(1..=v).contains(&classes) {
            return Err(MetaError::Shape(format!(
                "classes {classes} must be in 1..={v} (the logits' width)"
            )));
        }
        need_i64(d[1], "targets")?;
        let loss = norm_stats_dtype(d[0]);
        Ok(Inferred::outputs(
            rules::classifier(s[0], mode),
            &[loss, d[0]],
        ))
    }
    // The logits' gradient is saved for the backward.
    kernels_first_output_differentiable!(FORWARD);
    fn saves(&self, _needs: &[bool]) -> Saves {
        Saves::outputs(&[1])
    }
    fn backward(&self, g: &Grad<'_>) -> Result<Vec<Option<Tensor>>> {
        let dx = g.when(0, || {
            dispatch(Extern::new(ClassifierGrad).into(), &[g.output(1)?, g.dy()?])
        })?;
        Ok(vec![dx, None])
    }
}

impl ExternOp for ClassifierGrad {
    op_signature!("classifier_backward", 2);
    fn infer(&self, s: &[&Shape], d: &[DType], mode: RuleMode) -> MetaResult<Inferred> {
        logits_width(s, d)?;
        let loss = norm_stats_dtype(d[0]);
        if d[1] != loss {
            return Err(MetaError::DType(format!(
                "dloss must be {loss} for {} logits, got {}",
                d[0], d[1]
            )));
        }
        Ok(Inferred::new(rules::classifier_backward(s[0], mode), d[0]))
    }
    kernels_without_gradient!(BACKWARD);
}

/// The classifier's kernels composed of the cross-entropy kernels, on any backend.
pub(crate) struct Composed;

impl Composed {
    /// The forward composed of the cross-entropy kernels (the CPU's kernel, and the device's
    /// for f64): the loss, and its gradient for a unit incoming gradient. With padding
    /// (`classes` below the width) they run on the class columns (a narrowed copy), and the
    /// padding's gradient is a triangle no column reaches (exact zeros, whatever the padded
    /// logits hold), joined after them.
    pub(crate) fn forward<B: ComposingBackend>(
        b: &B,
        logits: &B::Piece,
        targets: &B::Piece,
        classes: usize,
        [loss, dlogits]: [&mut B::Out; 2],
    ) -> Result<()> {
        let spec = b.out_spec(dlogits);
        let (n, width) = match spec.shape.dims() {
            [n, w] => (*n, *w),
            _ => {
                return Err(kernel_err(
                    "classifier",
                    format!("logits gradient {} is not [N, V]", spec.shape),
                ))
            }
        };
        let ones = |b: &B, loss: &B::Piece| -> Result<B::Piece> {
            let spec = b.out_spec(loss);
            let zeros = scratch(b, &spec, |t| b.scalar(ScalarOp::Mul, 0.0, loss, t))?;
            scratch(b, &spec, |t| b.scalar(ScalarOp::Add, 1.0, &zeros, t))
        };
        if classes >= width {
            b.cross_entropy(logits, targets, loss)?;
            let ones = ones(b, loss)?;
            return b.cross_entropy_backward(logits, targets, &ones, dlogits);
        }
        let cols = |c: usize| OutSpec {
            shape: Shape::new([n, c]),
            dtype: spec.dtype,
        };
        let real = scratch(b, &cols(classes), |t| b.narrow(logits, 1, 0, classes, t))?;
        b.cross_entropy(&real, targets, loss)?;
        let ones = ones(b, loss)?;
        let dreal = scratch(b, &cols(classes), |t| {
            b.cross_entropy_backward(&real, targets, &ones, t)
        })?;
        drop(real);
        let pad = width - classes;
        let padded = scratch(b, &cols(pad), |t| b.narrow(logits, 1, classes, pad, t))?;
        let zeros = scratch(b, &cols(pad), |t| {
            b.triangular(&padded, Triangle::Upper, pad as i64, 0, 0, t)
        })?;
        drop(padded);
        b.concat(&[&dreal, &zeros], 1, dlogits)
    }

    /// The backward composed of a broadcasting product (dloss viewed as `[N, 1]`).
    pub(crate) fn backward<B: ComposingBackend>(
        b: &B,
        dlogits: &B::Piece,
        dloss: &B::Piece,
        out: &mut B::Out,
    ) -> Result<()> {
        let spec = b.out_spec(dloss);
        let column = OutSpec {
            shape: Shape::new([spec.shape.numel(), 1]),
            ..spec
        };
        let d = b.reshaped(dloss, &column)?;
        b.binary(BinaryOp::Mul, dlogits, &d, out)
    }
}

/// The fused classifier's per-row cross-entropy of logits `[N, V]` (a float dtype) against i64
/// targets `[N]`: loss `[N]`, f32 for f32 and 16-bit logits (f64 for f64). Its backward scales
/// the logits' gradient, computed and saved in the same pass; the logits are not kept.
pub fn classifier_loss(logits: &Tensor, targets: &Tensor) -> Result<Tensor> {
    let classes = match logits.shape().dims() {
        [_, v] => *v,
        // Not [N, V]: `infer` names the shapes.
        _ => 1,
    };
    classifier_loss_padded(logits, targets, classes)
}

/// [`classifier_loss`] over the first `classes` columns of logits `[N, V]` (`classes` in
/// `1..=V`): the columns from `classes` on are padding, outside the softmax, and their
/// gradient is 0. Logits whose classes are split over several ranks take the
/// vocabulary-parallel cross-entropy (no logits' gradient kept), with the fused op's checks
/// first so every layout refuses bad input alike.
pub fn classifier_loss_padded(logits: &Tensor, targets: &Tensor, classes: usize) -> Result<Tensor> {
    let op = Classifier { classes };
    if logits.has_sbp_over_ranks(|s| s == Sbp::S(1)) {
        let shapes = [logits.shape(), targets.shape()];
        op.infer(
            &shapes,
            &[logits.dtype(), targets.dtype()],
            RuleMode::ShapesOnly,
        )
        .map_err(|e| meta_err(&Extern::new(op).into(), e, &[logits, targets]))?;
        return vocab_parallel_cross_entropy(logits, targets, classes);
    }
    dispatch_first(op, &[logits, targets])
}
