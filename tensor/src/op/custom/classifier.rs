//! The fused classifier: per-row cross-entropy of logits `[N, V]` against i64 targets `[N]`,
//! computing the logits' gradient `softmax - onehot` in the same pass and saving it (in the
//! logits' dtype) for the backward, which only scales its rows by the incoming gradient: no
//! second softmax, and the logits themselves are not kept. The loss is f32 for f32 and 16-bit
//! logits (f64 for f64 ones). Only the first `classes` columns are classes: the columns from
//! `classes` on (a vocabulary padded to an aligned width) are outside the softmax and get a
//! zero gradient. Rows split or whole; a vocabulary split over several ranks takes the
//! vocabulary-parallel cross-entropy instead (see [`Tensor::cross_entropy_padded`]).

use oxiflow_dtype::DType;
use oxiflow_sbp::{rules, RuleMode, Shape};

use crate::op::{
    kernel_err, need_float, need_i64, norm_stats_dtype, scratch, single, BinaryOp, CustomKernels,
    Grad, Inferred, KernelBackend, MetaError, MetaResult, OpFamily, OutSpec, RunKernels, Saves,
    ScalarOp, Triangle,
};
use crate::tensor::Tensor;
use crate::Result;

/// The fused classifier and its backward.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum ClassifierOp {
    /// (logits `[N, V]`, targets `[N]` i64) -> (loss `[N]`, dlogits `[N, V]` = softmax - onehot
    /// over the first `classes` columns and 0 in the others, not differentiable); `classes`
    /// in `1..=V` (`V`: every column is a class). A target outside `0..classes` is a typed
    /// error on the CPU and gives its row NaN on a device (which cannot raise an error
    /// without a sync).
    Forward { classes: usize },
    /// (dlogits `[N, V]`, dloss `[N]`) -> dlogits with row i scaled by dloss\[i\] (computed in
    /// the loss's precision, rounded once).
    Backward,
}

/// Kernels of the fused classifier.
pub trait ClassifierKernels: KernelBackend {
    /// `out` = [loss, dlogits], over the first `classes` columns of `logits` (dlogits 0 in
    /// the others).
    fn classifier(
        &self,
        logits: &Self::Piece,
        targets: &Self::Piece,
        classes: usize,
        out: [&mut Self::Out; 2],
    ) -> Result<()>;
    /// `dlogits` with each row scaled by `dloss`'s value for it.
    fn classifier_backward(
        &self,
        dlogits: &Self::Piece,
        dloss: &Self::Piece,
        out: &mut Self::Out,
    ) -> Result<()>;
}


fn bad_shapes(what: &str, s: &[&Shape]) -> MetaError {
    MetaError::Shape(format!(
        "needs {what}, got {}",
        s.iter()
            .map(|x| x.to_string())
            .collect::<Vec<_>>()
            .join(", ")
    ))
}

impl OpFamily for ClassifierOp {
    fn name(&self) -> &'static str {
        match self {
            ClassifierOp::Forward { .. } => "classifier",
            ClassifierOp::Backward => "classifier_backward",
        }
    }

    fn arity(&self) -> (usize, usize) {
        (2, 2)
    }

    fn infer(&self, s: &[&Shape], d: &[DType], mode: RuleMode) -> MetaResult<Inferred> {
        need_float(d[0], "logits")?;
        let (x, rows) = (s[0], s[1]);
        let v = match x.dims() {
            [n, v] if rows.dims() == [*n] => *v,
            _ => return Err(bad_shapes("logits [N, V] and per-row values [N]", s)),
        };
        let loss = norm_stats_dtype(d[0]);
        match *self {
            ClassifierOp::Forward { classes } => {
                if !(1..=v).contains(&classes) {
                    return Err(MetaError::Shape(format!(
                        "classes {classes} must be in 1..={v} (the logits' width)"
                    )));
                }
                need_i64(d[1], "targets")?;
                Ok(Inferred::outputs(rules::classifier(x, mode), &[loss, d[0]]))
            }
            ClassifierOp::Backward => {
                if d[1] != loss {
                    return Err(MetaError::DType(format!(
                        "dloss must be {loss} for {} logits, got {}",
                        d[0], d[1]
                    )));
                }
                Ok(Inferred::new(rules::classifier_backward(x, mode), d[0]))
            }
        }
    }

    fn differentiable(&self, output: usize) -> bool {
        // The logits' gradient is saved for the backward.
        *self == ClassifierOp::Backward || output == 0
    }

    fn saves(&self, _needs: &[bool]) -> Saves {
        match self {
            ClassifierOp::Forward { .. } => Saves::outputs(&[1]),
            ClassifierOp::Backward => Saves::NOTHING,
        }
    }

    fn backward(&self, g: &Grad<'_>) -> Result<Vec<Option<Tensor>>> {
        if *self == ClassifierOp::Backward {
            return Err(Grad::unsupported(
                self.name(),
                "higher-order gradients are not supported",
            ));
        }
        let dx = g.when(0, || {
            Tensor::apply(ClassifierOp::Backward, &[g.output(1)?, g.dy()?])
        })?;
        Ok(vec![dx, None])
    }
}

impl<B: CustomKernels> RunKernels<B> for ClassifierOp {
    fn run(&self, b: &B, x: &[&B::Piece], out: &mut [B::Out]) -> Result<()> {
        match *self {
            ClassifierOp::Forward { classes } => match out {
                [loss, dlogits] => b.classifier(x[0], x[1], classes, [loss, dlogits]),
                _ => Err(kernel_err(
                    self.name(),
                    format!("expects 2 output buffers, got {}", out.len()),
                )),
            },
            ClassifierOp::Backward => b.classifier_backward(x[0], x[1], single(self.name(), out)?),
        }
    }
}

impl ClassifierOp {
    /// The forward composed of the cross-entropy kernels (the CPU's kernel, and the device's
    /// for f64): the loss, and its gradient for a unit incoming gradient. With padding
    /// (`classes` below the width) they run on the class columns (a narrowed copy), and the
    /// padding's gradient is a triangle no column reaches (exact zeros, whatever the padded
    /// logits hold), joined after them.
    pub fn composed_forward<B>(
        b: &B,
        logits: &B::Piece,
        targets: &B::Piece,
        classes: usize,
        [loss, dlogits]: [&mut B::Out; 2],
    ) -> Result<()>
    where
        B: CustomKernels + KernelBackend<Out = <B as KernelBackend>::Piece>,
    {
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
    pub fn composed_backward<B>(
        b: &B,
        dlogits: &B::Piece,
        dloss: &B::Piece,
        out: &mut B::Out,
    ) -> Result<()>
    where
        B: CustomKernels + KernelBackend<Out = <B as KernelBackend>::Piece>,
    {
        let spec = b.out_spec(dloss);
        let column = OutSpec {
            shape: Shape::new([spec.shape.numel(), 1]),
            ..spec
        };
        let d = b.reshaped(dloss, &column)?;
        b.binary(BinaryOp::Mul, dlogits, &d, out)
    }
}
