//! Dispatching an op of two outputs and taking them as a pair.

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
