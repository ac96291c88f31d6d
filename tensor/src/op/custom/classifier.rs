//! The fused classifier: per-row cross-entropy of logits `[N, V]` against i64 targets `[N]`,
//! computing the logits' gradient `softmax - onehot` in the same pass and saving it (in the
//! logits' dtype) for the backward, which only scales its rows by the incoming gradient: no
//! second softmax, and the logits themselves are not kept. The loss is f32 for f32 and 16-bit
//! logits (f64 for f64 ones). Only the first `classes` columns are classes: the columns from
//! `classes` on (a vocabulary padded to an aligned width) are outside the softmax and get a
//! zero gradient. Rows split or whole; a vocabulary split over several ranks takes the
//! vocabulary-parallel cross-entropy instead (see [`Tensor::cross_entropy_padded`]).

use oxiflow_dtype::DType;
use oxiflow_sbp::{RuleMode, Rules, Sbp, Shape};

use crate::dispatch::{dispatch, dispatch_multi, meta_err};
use crate::op::loss::{classes_split, vocab_parallel_cross_entropy};
use crate::op::{
    kernel_err, need_float, need_i64, norm_stats_dtype, scratch, single, Backend, BinaryOp, Grad,
    Inferred, KernelBackend, MetaError, MetaResult, OpFamily, OutSpec, Saves, ScalarOp, Triangle,
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

const B: Sbp = Sbp::Broadcast;

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
        let (n, v) = match x.dims() {
            [n, v] if rows.dims() == [*n] => (*n, *v),
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
                let mut r = Rules::new(mode, [Shape::new([n]), x.clone()]);
                // Rows split or whole; never P (not linear), classes whole.
                r.push(&[Sbp::S(0), Sbp::S(0)], &[Sbp::S(0), Sbp::S(0)]);
                r.push(&[B, B], &[B, B]);
                Ok(Inferred::outputs(r, &[loss, d[0]]))
            }
            ClassifierOp::Backward => {
                if d[1] != loss {
                    return Err(MetaError::DType(format!(
                        "dloss must be {loss} for {} logits, got {}",
                        d[0], d[1]
                    )));
                }
                let mut r = Rules::new(mode, [x.clone()]);
                r.push(&[Sbp::S(0), Sbp::S(0)], &[Sbp::S(0)]);
                r.push(&[Sbp::S(1), B], &[Sbp::S(1)]);
                // Linear in dloss.
                r.push(&[B, Sbp::P], &[Sbp::P]);
                r.push(&[B, B], &[B]);
                Ok(Inferred::new(r, d[0]))
            }
        }
    }

    fn run<B: Backend>(&self, b: &B, x: &[&B::Piece], out: &mut [B::Out]) -> Result<()> {
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
            dispatch(ClassifierOp::Backward.into(), &[g.output(1)?, g.dy()?])
        })?;
        Ok(vec![dx, None])
    }
}

impl ClassifierOp {
    /// The forward composed of the cross-entropy kernels (the CPU's kernel, and the device's
    /// for f64): the loss, and its gradient for a unit incoming gradient. With padding
    /// (`classes` below the width) they run on the class columns (a narrowed copy), and the
    /// padding's gradient is a triangle no column reaches (exact zeros, whatever the padded
    /// logits hold), joined after them.
    pub(crate) fn composed_forward<B>(
        b: &B,
        logits: &B::Piece,
        targets: &B::Piece,
        classes: usize,
        [loss, dlogits]: [&mut B::Out; 2],
    ) -> Result<()>
    where
        B: Backend + KernelBackend<Out = <B as KernelBackend>::Piece>,
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
    pub(crate) fn composed_backward<B>(
        b: &B,
        dlogits: &B::Piece,
        dloss: &B::Piece,
        out: &mut B::Out,
    ) -> Result<()>
    where
        B: Backend + KernelBackend<Out = <B as KernelBackend>::Piece>,
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

impl Tensor {
    /// Per-row cross-entropy of logits `[N, V]` against targets `[N]` (i64) -> `[N]` (f32; f64
    /// for f64 logits), through the fused classifier: the logits' gradient is computed in the
    /// forward and kept in their dtype, the logits are not. Logits split on the classes over
    /// several ranks take the vocabulary-parallel cross-entropy instead (the same loss in the
    /// same dtype; the logits stay split and are kept for the backward, in their dtype).
    pub fn classifier_loss(&self, targets: &Tensor) -> Result<Tensor> {
        let classes = match self.shape().dims() {
            [_, v] => *v,
            // Not [N, V]: `infer` names the shapes.
            _ => 1,
        };
        self.classifier_loss_padded(targets, classes)
    }

    /// [`Tensor::classifier_loss`] over the first `classes` columns of logits `[N, V]` (`classes`
    /// in `1..=V`): the columns from `classes` on are padding (a vocabulary rounded up to an
    /// aligned width), outside the softmax, and their gradient is 0; targets must be below
    /// `classes`. `classes == V` is [`Tensor::classifier_loss`].
    pub fn classifier_loss_padded(&self, targets: &Tensor, classes: usize) -> Result<Tensor> {
        let op = ClassifierOp::Forward { classes };
        if classes_split(self) {
            // The fused op's checks first, so every layout refuses bad input alike.
            let shapes = [self.shape(), targets.shape()];
            op.infer(
                &shapes,
                &[self.dtype(), targets.dtype()],
                RuleMode::ShapesOnly,
            )
            .map_err(|e| meta_err(&op.into(), e, &[self, targets]))?;
            return vocab_parallel_cross_entropy(self, targets, classes);
        }
        let out = dispatch_multi(op.into(), &[self, targets])?;
        out.into_iter()
            .next()
            .ok_or_else(|| kernel_err("classifier", "gave no output".into()))
    }
}
