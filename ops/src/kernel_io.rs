//! What the kernels of this crate share about a call: its inputs and output buffers as arrays
//! of the op's arity, or the typed error naming the op and both counts; and the check of a
//! device piece's shape and dtype.

use oxiflow_cuda::{device_error, CudaStorage};
use oxiflow_dtype::DType;
use oxiflow_tensor::{Result, TensorError};

/// `inputs` as `I` pieces and `outputs` as `N` buffers, or the kernel error of `op`.
pub(crate) fn io_arrays<'a, 'p, P, O, const I: usize, const N: usize>(
    op: &'static str,
    inputs: &'a [&'p P],
    outputs: &'a mut [O],
) -> Result<([&'p P; I], &'a mut [O; N])> {
    let (n_in, n_out) = (inputs.len(), outputs.len());
    match (
        <[&P; I]>::try_from(inputs),
        <&mut [O; N]>::try_from(outputs),
    ) {
        (Ok(i), Ok(o)) => Ok((i, o)),
        _ => Err(TensorError::Kernel {
            op,
            detail: format!("expects {I} inputs and {N} output buffers, got {n_in} and {n_out}"),
        }),
    }
}

/// A typed error of `op` unless the device piece `p` (named `what`) has `shape` and `dtype`.
pub(crate) fn expect(
    op: &'static str,
    what: &str,
    p: &CudaStorage,
    shape: &[usize],
    dtype: DType,
) -> Result<()> {
    if p.shape().dims() == shape && p.dtype() == dtype {
        return Ok(());
    }
    Err(device_error(
        op,
        format!(
            "{what} is {} {}, want {dtype} {shape:?}",
            p.dtype(),
            p.shape()
        ),
    ))
}
