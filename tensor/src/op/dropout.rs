//! Dropout: `y = x * keep / (1 - p)` with `keep = rng::uniform(seed, i) >= p` for the global
//! row-major element index `i`, so the mask does not depend on placement, SBP, mesh or device,
//! and a local run draws the same mask as any global layout. Linear in `x` (splits, broadcast
//! and partial sums pass through); its gradient is the same dropout of the output gradient.

use oxiflow_collectives::DType;
use oxiflow_sbp::{rules, RuleMode, Shape};

use super::grad::Grad;
use super::{
    kernel_err, need_float, Backend, Dims, F64Bits, Inferred, KernelBackend, LocalAt, MetaError,
    OpFamily, OutSpec,
};
use crate::dispatch::dispatch;
use crate::tensor::Tensor;
use crate::Result;

/// The dropout family: drop probability `p` in `[0, 1)`, mask seed `seed`. `global` and
/// `starts` say where the piece sits: the global shape and the piece's first index on each dim
/// (the whole tensor, starting at 0, until [`OpFamily::local`] sets a rank's region).
#[derive(Clone, Debug, PartialEq, Eq, Hash)]
pub struct DropoutOp {
    pub p: F64Bits,
    pub seed: u64,
    pub global: Shape,
    pub starts: Dims,
}

/// Dropout kernels of a backend (float pieces): element at local index `l` of the piece has
/// global index `sum((starts[d] + l[d]) * global_strides[d])`.
pub trait DropoutKernels: KernelBackend {
    fn dropout(&self, x: &Self::Piece, op: &DropoutOp, out: &OutSpec) -> Result<Self::Piece>;
}

impl DropoutOp {
    /// `1 / (1 - p)`, the scale of kept elements.
    pub fn keep_scale(&self) -> f64 {
        1.0 / (1.0 - self.p.get())
    }

    /// Checks that a piece of shape `local` lies inside `global` at `starts`, and that the
    /// global element count fits a `usize` (so no global index overflows).
    pub fn check_piece(&self, local: &[usize]) -> Result<()> {
        let global = self.global.dims();
        let fits = global.len() == local.len()
            && self.starts.len() == local.len()
            && self.global.checked_numel().is_some()
            && local
                .iter()
                .zip(&self.starts)
                .zip(global)
                .all(|((&n, &s), &g)| s.checked_add(n).is_some_and(|end| end <= g));
        if fits {
            Ok(())
        } else {
            Err(kernel_err(
                "dropout",
                format!(
                    "piece {local:?} at {:?} does not lie in the global shape {}",
                    self.starts.as_slice(),
                    self.global
                ),
            ))
        }
    }
}

impl OpFamily for DropoutOp {
    fn name(&self) -> &'static str {
        "dropout"
    }

    fn arity(&self) -> (usize, usize) {
        (1, 1)
    }

    fn infer(
        &self,
        s: &[&Shape],
        d: &[DType],
        mode: RuleMode,
    ) -> std::result::Result<Inferred, MetaError> {
        need_float(d[0], "input")?;
        let p = self.p.get();
        if !(0.0..1.0).contains(&p) {
            return Err(MetaError::Shape(format!(
                "drop probability p must be in [0, 1), got {p}"
            )));
        }
        Ok(Inferred::new(rules::unary(s[0], true, mode), d[0]))
    }

    fn local(&self, at: &LocalAt<'_>) -> Option<Self> {
        Some(DropoutOp {
            global: at.out_global.clone(),
            starts: (0..at.out_global.ndim()).map(|d| at.out_start(d)).collect(),
            ..self.clone()
        })
    }

    fn run<B: Backend>(&self, b: &B, x: &[&B::Piece], out: &OutSpec) -> Result<B::Piece> {
        b.dropout(x[0], self, out)
    }

    fn backward(&self, g: &Grad<'_>) -> Result<Vec<Option<Tensor>>> {
        Grad::one(g.dy.dropout(self.p.get(), self.seed)?)
    }
}

impl Tensor {
    /// Dropout with drop probability `p` in `[0, 1)` and mask seed `seed`: element `i` (global
    /// row-major index) is kept, scaled by `1 / (1 - p)`, when `rng::uniform(seed, i) >= p`,
    /// else zeroed. `p == 0` returns the input itself.
    pub fn dropout(&self, p: f64, seed: u64) -> Result<Tensor> {
        if p == 0.0 && self.dtype().is_float() {
            return Ok(self.clone());
        }
        let shape = self.shape().clone();
        let starts = std::iter::repeat_n(0, shape.ndim()).collect();
        let op = DropoutOp {
            p: F64Bits::new(p),
            seed,
            global: shape,
            starts,
        };
        dispatch(op.into(), &[self])
    }
}
