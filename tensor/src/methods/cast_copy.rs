//! Casts that stand for a copy made already: [`Tensor::cast_as_copy`] and
//! [`Tensor::cast_boxed_as_copy`] give a tensor another op wrote (the compute copy an optimizer
//! update wrote beside the new value, a 16-bit copy of a master shard gathered ahead of use)
//! with autograd recording the cast, so no kernel runs and gradients flow as through the cast.

use crate::tensor::Tensor;
use crate::{Result, TensorError};

impl Tensor {
    /// This tensor cast to `copy`'s dtype, where `copy` holds exactly those values (the
    /// compute copy AdamW wrote with the update that made this tensor): no kernel runs, and
    /// autograd records the cast of this tensor, so its gradient arrives in its own dtype as
    /// through [`Tensor::to_dtype`]. `copy` must have this tensor's shape and layout (or be
    /// local on its device) and a float dtype.
    pub fn cast_as_copy(&self, copy: &Tensor) -> Result<Tensor> {
        let fits = copy.shape() == self.shape()
            && copy.layout() == self.layout()
            && copy.is_global() == self.is_global()
            && (self.is_global() || copy.device() == self.device())
            && copy.dtype().is_float();
        if !fits {
            return Err(TensorError::Shape {
                op: "cast_as_copy",
                shapes: format!("{}, {}", self.shape(), copy.shape()),
                sbps: format!("{:?}, {:?}", self.nd_sbp(), copy.nd_sbp()),
                detail: format!("{} is not a copy of {}", copy.describe(), self.describe()),
            });
        }
        if copy.dtype() == self.dtype() {
            return Ok(self.clone());
        }
        Ok(self.recorded_cast_to(copy))
    }

    /// `copy` (detached), with autograd recording it as this tensor cast to its dtype.
    fn recorded_cast_to(&self, copy: &Tensor) -> Tensor {
        let out = copy.detach();
        let cast = crate::op::ElementwiseOp::Cast(copy.dtype());
        crate::autograd::record(&cast.into(), &[self], std::slice::from_ref(&out));
        out
    }

    /// This global leaf cast to `copy`'s dtype and boxed to `copy`'s layout, where `copy` is
    /// that result made already (bit for bit what the cast and `to_global` give, e.g. a 16-bit
    /// copy of a master shard gathered ahead of use): `copy` itself, with autograd recording
    /// the cast alone, so the leaf's gradient arrives cast back to its dtype but in the
    /// gradient's own layout (a partial sum, say) for the leaf's grad layout or a bucket to box
    /// (`Tensor::set_grad_layout`, `GradReadyHook`), as a whole leaf's gradient does.
    /// Communicates nothing. A tensor with autograd history, or a `copy` of another shape or
    /// placement or not of a float dtype, is a typed error.
    pub fn cast_boxed_as_copy(&self, copy: &Tensor) -> Result<Tensor> {
        let fits = match (self.placement(), copy.placement(), copy.nd_sbp()) {
            (Some(p), Some(q), Some(_)) => {
                p.same_as(q) && copy.shape() == self.shape() && copy.dtype().is_float()
            }
            _ => false,
        };
        if !fits || !self.is_leaf() {
            return Err(TensorError::Shape {
                op: "cast_boxed_as_copy",
                shapes: format!("{}, {}", self.shape(), copy.shape()),
                sbps: format!("{:?}, {:?}", self.nd_sbp(), copy.nd_sbp()),
                detail: format!(
                    "{} is not a cast and boxing of the leaf {} (both global, one placement and \
                     shape, a float copy)",
                    copy.describe(),
                    self.describe()
                ),
            });
        }
        if copy.dtype() == self.dtype() && copy.nd_sbp() == self.nd_sbp() {
            // The copy is this leaf's own value.
            return Ok(self.clone());
        }
        Ok(self.recorded_cast_to(copy))
    }
}
