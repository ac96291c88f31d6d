//! Dropout: `y = x * keep / (1 - p)` with `keep = rng::uniform(seed, i) >= p` for the global
//! row-major element index `i`, so the mask does not depend on placement, SBP, mesh or device,
//! and a local run draws the same mask as any global layout. `dropout_in` places the tensor in
//! a larger *frame* (a micro-batch in its batch), so its mask is that part of the frame's.
//! Linear in `x` (splits, broadcast and partial sums pass through); its gradient is the same
//! dropout of the output gradient.

use oxiflow_dtype::DType;
use oxiflow_sbp::{rules, RuleMode, Shape};

use super::grad::Grad;
use super::{
    kernel_err, kernel_trait, name_and_arity, need_float, single, Dims, F64Bits, Inferred, LocalAt,
    MetaError, MetaResult, OpFamily, RunKernels, Saves,
};
use crate::tensor::Tensor;
use crate::Result;

/// The dropout family: drop probability `p` in `[0, 1)`, mask seed `seed`. `global` and
/// `starts` say where the piece sits: the frame's shape and the piece's first index in it on
/// each dim (the tensor's own shape and its position in the frame, 0 for `dropout`, until
/// [`OpFamily::local`] adds a rank's region).
#[derive(Clone, Debug, PartialEq, Eq, Hash)]
pub struct DropoutOp {
    pub p: F64Bits,
    pub seed: u64,
    pub global: Shape,
    pub starts: Dims,
}

kernel_trait! {
    /// Dropout kernels of a backend (float pieces): element at local index `l` of the piece has
    /// global index `sum((starts[d] + l[d]) * global_strides[d])`.
    pub trait DropoutKernels {
        fn dropout(x: &Self::Piece, op: &DropoutOp);
    }
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
    name_and_arity!("dropout", 1);

    fn infer(&self, s: &[&Shape], d: &[DType], mode: RuleMode) -> MetaResult<Inferred> {
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
        // The kernel's `check_piece` refuses a piece outside the frame (a saturated start too).
        Some(DropoutOp {
            starts: self
                .starts
                .iter()
                .enumerate()
                .map(|(d, &s)| s.saturating_add(at.out_start(d)))
                .collect(),
            ..self.clone()
        })
    }

    fn saves(&self, _needs: &[bool]) -> Saves {
        // The mask is redrawn from the seed.
        Saves::NOTHING
    }

    fn backward(&self, g: &Grad<'_>) -> Result<Vec<Option<Tensor>>> {
        Grad::one(
            g.dy()?
                .dropout_in(self.p.get(), self.seed, &self.global, &self.starts)?,
        )
    }
}

impl<B: DropoutKernels> RunKernels<B> for DropoutOp {
    fn run(&self, b: &B, x: &[&B::Piece], out: &mut [B::Out]) -> Result<()> {
        let y = single(self.name(), out)?;
        b.dropout(x[0], self, y)
    }
}
