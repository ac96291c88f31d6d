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
//! cross-entropy instead ([`Tensor::linear_classifier_loss_sum`] chooses). Its products run
//! at the op's [`MatmulPrecision`].

use oxiflow_dtype::{DType, MatmulPrecision};
use oxiflow_sbp::{rules, RuleMode, Shape};

use crate::op::{
    kernel_err, need_i64, norm_stats_dtype, same_float_dtype, scratch, BinaryOp, CustomKernels,
    Grad, Inferred, KernelBackend, MetaError, MetaResult, OpFamily, OutSpec, RunKernels, Saves,
};
use crate::tensor::Tensor;
use crate::Result;

/// The fused linear cross-entropy and its backward.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum LinearClassifier {
    /// Over the first `classes` rows of the table (`classes` in `1..=V`): (x `[N, C]`, w
    /// `[V, C]`, targets `[N]` i64) -> (loss `[]`, dx `[N, C]`, dw `[V, C]`), the loss f32 for
    /// 16-bit and f32 data (f64 for f64), dx and dw in the data's dtype and not
    /// differentiable.
    Forward {
        classes: usize,
        precision: MatmulPrecision,
    },
    /// (dx, dw, dloss `[]`) -> (dx, dw) each times dloss (computed in the loss's precision,
    /// rounded once).
    Backward,
}

/// At most this many bytes of logits live at once in a chunked kernel.
pub const CHUNK_BYTES: usize = 512 << 20;

/// Kernels of the fused linear cross-entropy.
pub trait LinearClassifierKernels: KernelBackend {
    /// `out` = [loss, dx, dw] (see [`LinearClassifier::Forward`]); a target outside
    /// `0..classes` is a typed error on the CPU and makes the loss NaN on a device.
    fn linear_classifier(
        &self,
        x: &Self::Piece,
        w: &Self::Piece,
        targets: &Self::Piece,
        classes: usize,
        precision: MatmulPrecision,
        out: [&mut Self::Out; 3],
    ) -> Result<()>;
    /// `out[i]` = `saved[i]` times the one value of `dloss`.
    fn linear_classifier_backward(
        &self,
        saved: [&Self::Piece; 2],
        dloss: &Self::Piece,
        out: [&mut Self::Out; 2],
    ) -> Result<()>;
}


impl OpFamily for LinearClassifier {
    fn name(&self) -> &'static str {
        match self {
            LinearClassifier::Forward { .. } => "linear_classifier",
            LinearClassifier::Backward => "linear_classifier_backward",
        }
    }

    fn arity(&self) -> (usize, usize) {
        (3, 3)
    }

    fn infer(&self, s: &[&Shape], d: &[DType], mode: RuleMode) -> MetaResult<Inferred> {
        match *self {
            LinearClassifier::Forward { classes, .. } => forward_rules(classes, s, d, mode),
            LinearClassifier::Backward => {
                let dt = same_float_dtype(&d[..2], "gradients")?;
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
        }
    }

    fn differentiable(&self, output: usize) -> bool {
        // The forward's gradients are saved for the backward.
        *self == LinearClassifier::Backward || output == 0
    }

    fn saves(&self, needs: &[bool]) -> Saves {
        let need = |i: usize| needs.get(i).copied().unwrap_or(false);
        match self {
            LinearClassifier::Forward { .. } => {
                let either = need(0) || need(1);
                Saves::NOTHING
                    .and_output_if(1, either)
                    .and_output_if(2, either)
            }
            LinearClassifier::Backward => Saves::NOTHING,
        }
    }

    fn backward(&self, g: &Grad<'_>) -> Result<Vec<Option<Tensor>>> {
        if *self == LinearClassifier::Backward {
            return Err(Grad::unsupported(
                self.name(),
                "higher-order gradients are not supported",
            ));
        }
        let (need_x, need_w) = (g.need(0), g.need(1));
        if !need_x && !need_w {
            return Ok(vec![None, None, None]);
        }
        // Both are saved whenever either is wanted, so one op scales them; an unwanted one's
        // output is dropped.
        let ins = [g.output(1)?, g.output(2)?, g.dy()?];
        let mut out = Tensor::apply_all(LinearClassifier::Backward, &ins)?.into_iter();
        let (dx, dw) = (out.next(), out.next());
        Ok(vec![dx.filter(|_| need_x), dw.filter(|_| need_w), None])
    }
}

impl<B: CustomKernels> RunKernels<B> for LinearClassifier {
    fn run(&self, b: &B, x: &[&B::Piece], out: &mut [B::Out]) -> Result<()> {
        match (*self, out) {
            (LinearClassifier::Forward { classes, precision }, [loss, dx, dw]) => {
                b.linear_classifier(x[0], x[1], x[2], classes, precision, [loss, dx, dw])
            }
            (LinearClassifier::Backward, [dx, dw]) => {
                b.linear_classifier_backward([x[0], x[1]], x[2], [dx, dw])
            }
            (_, out) => Err(kernel_err(
                self.name(),
                format!("got {} output buffers", out.len()),
            )),
        }
    }
}

/// The forward's shape and dtype checks and its rules.
fn forward_rules(
    classes: usize,
    s: &[&Shape],
    d: &[DType],
    mode: RuleMode,
) -> MetaResult<Inferred> {
    let dt = same_float_dtype(&d[..2], "x and table")?;
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

impl LinearClassifier {
    /// The backward composed of broadcasting products (dloss viewed as `[1, 1]`).
    pub fn composed_backward<B>(
        b: &B,
        saved: [&B::Piece; 2],
        dloss: &B::Piece,
        out: [&mut B::Out; 2],
    ) -> Result<()>
    where
        B: CustomKernels + KernelBackend<Out = <B as KernelBackend>::Piece>,
    {
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
    pub fn composed<B>(
        b: &B,
        x: &B::Piece,
        w: &B::Piece,
        targets: &B::Piece,
        (classes, precision): (usize, MatmulPrecision),
        [loss, dx, dw]: [&mut B::Out; 3],
    ) -> Result<()>
    where
        B: CustomKernels + KernelBackend<Out = <B as KernelBackend>::Piece>,
    {
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
            b.classifier(&logits, targets, classes, [&mut rows, &mut d])?;
        }
        drop(logits);
        let (rows, d) = (b.finish(rows), b.finish(d));
        b.matmul_t(&d, w, (false, false), false, precision, dx)?;
        b.matmul_t(&d, x, (true, false), false, precision, dw)?;
        b.sum_to_shape(&rows, loss)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn infer_checks_shapes_classes_and_dtypes() {
        let op = LinearClassifier::Forward {
            classes: 5,
            precision: MatmulPrecision::F32,
        };
        let (x, w, t) = (Shape::new([4, 3]), Shape::new([6, 3]), Shape::new([4]));
        let ok = op.infer(
            &[&x, &w, &t],
            &[DType::F32, DType::F32, DType::I64],
            RuleMode::ShapesOnly,
        );
        assert!(ok.is_ok());
        let bad_c = Shape::new([6, 2]);
        assert!(op
            .infer(
                &[&x, &bad_c, &t],
                &[DType::F32, DType::F32, DType::I64],
                RuleMode::ShapesOnly
            )
            .is_err());
        let wide = LinearClassifier::Forward {
            classes: 7,
            precision: MatmulPrecision::F32,
        };
        assert!(wide
            .infer(
                &[&x, &w, &t],
                &[DType::F32, DType::F32, DType::I64],
                RuleMode::ShapesOnly
            )
            .is_err());
        assert!(op
            .infer(
                &[&x, &w, &t],
                &[DType::F32, DType::F32, DType::F32],
                RuleMode::ShapesOnly
            )
            .is_err());
        assert!(op
            .infer(
                &[&x, &w, &t],
                &[DType::F32, DType::BF16, DType::I64],
                RuleMode::ShapesOnly
            )
            .is_err());
    }
}
