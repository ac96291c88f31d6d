//! The backends the composed kernels of this crate run on: every core kernel, and output
//! buffers that are pieces, so one kernel's output is the next one's input.

use oxiflow_tensor::backend::CoreKernels;
use oxiflow_tensor::KernelBackend;

/// A backend with the core kernels whose output buffers are its pieces (the CPU's and the
/// device's), on which a fused op's kernel is written as core kernels in sequence.
pub(crate) trait ComposingBackend:
    CoreKernels + KernelBackend<Out = <Self as KernelBackend>::Piece>
{
}

impl<B: CoreKernels + KernelBackend<Out = <B as KernelBackend>::Piece>> ComposingBackend for B {}
