//! Dispatching an op of several outputs and taking what its caller gets: the first (the
//! others are saved for its backward), or two as a pair.

use oxiflow_tensor::{dispatch_multi, Extern, ExternOp, Result, Tensor, TensorError};

/// `op` on `inputs`, its two outputs as a pair (a kernel error naming the op if it gave fewer).
pub(crate) fn dispatch_pair(op: impl ExternOp, inputs: &[&Tensor]) -> Result<(Tensor, Tensor)> {
    let name = op.name();
    let mut outputs = dispatch_multi(Extern::new(op).into(), inputs)?.into_iter();
    match (outputs.next(), outputs.next()) {
        (Some(a), Some(b)) => Ok((a, b)),
        _ => Err(TensorError::Kernel {
            op: name,
            detail: "the op gave fewer than 2 outputs".into(),
        }),
    }
}

/// `op` on `inputs`, its first output (a kernel error naming the op if it gave none).
pub(crate) fn dispatch_first(op: impl ExternOp, inputs: &[&Tensor]) -> Result<Tensor> {
    let name = op.name();
    dispatch_multi(Extern::new(op).into(), inputs)?
        .into_iter()
        .next()
        .ok_or_else(|| TensorError::Kernel {
            op: name,
            detail: "the op gave no output".into(),
        })
}
