//! The fused classifier: per-row cross-entropy of logits `[N, V]` against i64 targets `[N]`,
//! computing the logits' gradient `softmax - onehot` in the same pass and saving it (in the
//! logits' dtype) for the backward, which only scales its rows by the incoming gradient: no
//! second softmax, and the logits themselves are not kept. The loss is f32 for f32 and 16-bit
//! logits (f64 for f64 ones). Rows split or whole; a vocabulary split over several ranks takes
//! the vocabulary-parallel cross-entropy instead ([`Tensor::cross_entropy`]).

use oxiflow_dtype::DType;
use oxiflow_sbp::{RuleMode, Rules, Sbp, Shape};

use crate::dispatch::{dispatch, dispatch_multi};
use crate::op::{
    kernel_err, need_float, need_i64, norm_stats_dtype, scratch, single, Backend, BinaryOp,
    Grad, Inferred, KernelBackend, MetaError, OpFamily, OutSpec, Saves, ScalarOp,
};
use crate::tensor::Tensor;
use crate::Result;

/// The fused classifier and its backward.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum ClassifierOp {
    /// (logits `[N, V]`, targets `[N]` i64) -> (loss `[N]`, dlogits `[N, V]` = softmax - onehot,
    /// not differentiable). A target outside `0..V` is a typed error on the CPU and gives its
    /// row NaN on a device (which cannot raise an error without a sync).
    Forward,
    /// (dlogits `[N, V]`, dloss `[N]`) -> dlogits with row i scaled by dloss\[i\] (computed in
    /// the loss's precision, rounded once).
    Backward,
}

/// Kernels of the fused classifier.
pub trait ClassifierKernels: KernelBackend {
    /// `out` = [loss, dlogits].
    fn classifier(
        &self,
        logits: &Self::Piece,
        targets: &Self::Piece,
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
            ClassifierOp::Forward => "classifier",
            ClassifierOp::Backward => "classifier_backward",
        }
    }

    fn arity(&self) -> (usize, usize) {
        (2, 2)
    }

    fn infer(
        &self,
        s: &[&Shape],
        d: &[DType],
        mode: RuleMode,
    ) -> std::result::Result<Inferred, MetaError> {
        need_float(d[0], "logits")?;
        let (x, rows) = (s[0], s[1]);
        let n = match x.dims() {
            [n, _] if rows.dims() == [*n] => *n,
            _ => return Err(bad_shapes("logits [N, V] and per-row values [N]", s)),
        };
        let loss = norm_stats_dtype(d[0]);
        match self {
            ClassifierOp::Forward => {
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
        match self {
            ClassifierOp::Forward => match out {
                [loss, dlogits] => b.classifier(x[0], x[1], [loss, dlogits]),
                _ => Err(kernel_err(
                    self.name(),
                    format!("expects 2 output buffers, got {}", out.len()),
                )),
            },
            ClassifierOp::Backward => {
                b.classifier_backward(x[0], x[1], single(self.name(), out)?)
            }
        }
    }

    fn differentiable(&self, output: usize) -> bool {
        // The logits' gradient is saved for the backward.
        *self == ClassifierOp::Backward || output == 0
    }

    fn saves(&self, _needs: &[bool]) -> Saves {
        match self {
            ClassifierOp::Forward => Saves::outputs(&[1]),
            ClassifierOp::Backward => Saves::NOTHING,
        }
    }

    fn backward(&self, g: &Grad<'_>) -> Result<Vec<Option<Tensor>>> {
        if *self != ClassifierOp::Forward {
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
    /// for f64): the loss, and its gradient for a unit incoming gradient.
    pub(crate) fn composed_forward<B>(
        b: &B,
        logits: &B::Piece,
        targets: &B::Piece,
        [loss, dlogits]: [&mut B::Out; 2],
    ) -> Result<()>
    where
        B: Backend + KernelBackend<Out = <B as KernelBackend>::Piece>,
    {
        b.cross_entropy(logits, targets, loss)?;
        let spec = b.out_spec(loss);
        let zeros = scratch(b, &spec, |t| b.scalar(ScalarOp::Mul, 0.0, loss, t))?;
        let ones = scratch(b, &spec, |t| b.scalar(ScalarOp::Add, 1.0, &zeros, t))?;
        b.cross_entropy_backward(logits, targets, &ones, dlogits)
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
    /// several ranks are boxed to whole rows (use [`Tensor::cross_entropy`] to keep them split).
    pub fn classifier_loss(&self, targets: &Tensor) -> Result<Tensor> {
        let out = dispatch_multi(ClassifierOp::Forward.into(), &[self, targets])?;
        out.into_iter()
            .next()
            .ok_or_else(|| kernel_err("classifier", "gave no output".into()))
    }
}
