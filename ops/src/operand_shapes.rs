//! What the fused ops share about their operands' shapes: a list of shapes as an error message
//! prints it, a shape with its last dim changed, and the check of a layer's input (one float
//! dtype, at least one dim) that gives its feature width.

use oxiflow_dtype::DType;
use oxiflow_sbp::Shape;
use oxiflow_tensor::{MetaError, MetaResult};

use crate::operand_dtypes::one_float_dtype;

/// The shapes, comma-separated.
pub(crate) fn shapes_text(s: &[&Shape]) -> String {
    s.iter()
        .map(|x| x.to_string())
        .collect::<Vec<_>>()
        .join(", ")
}

/// `x`'s shape with its last dim `n`.
pub(crate) fn with_last(x: &Shape, n: usize) -> Shape {
    let mut d = x.dims().to_vec();
    if let Some(l) = d.last_mut() {
        *l = n;
    }
    Shape::new(d)
}

/// The one float dtype of the operands and the last dim of the first (`x` `[.., K]`).
pub(crate) fn float_last_dim(s: &[&Shape], d: &[DType]) -> MetaResult<(DType, usize)> {
    let dt = one_float_dtype(d)?;
    match s[0].dims().last() {
        Some(&k) => Ok((dt, k)),
        None => Err(MetaError::Shape("x must have at least one dim".into())),
    }
}
