//! The dtype check the element-wise fused ops share: every operand of one float dtype.

use oxiflow_dtype::DType;
use oxiflow_tensor::{MetaError, MetaResult};

/// The one float dtype of `dtypes`, or why they are not.
pub(crate) fn one_float_dtype(dtypes: &[DType]) -> MetaResult<DType> {
    let d = dtypes[0];
    if dtypes.iter().any(|&x| x != d) {
        let all: Vec<String> = dtypes.iter().map(|d| d.to_string()).collect();
        return Err(MetaError::DType(format!(
            "operands must have the same dtype, got {}",
            all.join(", ")
        )));
    }
    if !d.is_float() {
        return Err(MetaError::DType(format!(
            "operands must be a float dtype, got {d}"
        )));
    }
    Ok(d)
}
