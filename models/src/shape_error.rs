//! The shape errors of the models' ops: a tensor, or a pair of tensors, that does not fit what
//! an op takes, named with its shape and its nd-SBP.

use oxiflow_tensor::{Tensor, TensorError};

/// `op` refuses `x` (its shape and nd-SBP in the error) for `detail`.
pub(crate) fn shape_err(op: &'static str, x: &Tensor, detail: String) -> TensorError {
    TensorError::Shape {
        op,
        shapes: x.shape().to_string(),
        sbps: format!("{:?}", x.nd_sbp()),
        detail,
    }
}

/// `op` refuses the pair `a`, `b` (their shapes and nd-SBPs in the error, in that order) for
/// `detail`.
pub(crate) fn pair_shape_err(
    op: &'static str,
    a: &Tensor,
    b: &Tensor,
    detail: String,
) -> TensorError {
    TensorError::Shape {
        op,
        shapes: format!("{}, {}", a.shape(), b.shape()),
        sbps: format!("{:?}, {:?}", a.nd_sbp(), b.nd_sbp()),
        detail,
    }
}
