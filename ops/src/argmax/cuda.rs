//! The arg-max's CUDA kernel (`argmax.cu`), compiled once per process through the library's
//! NVRTC path and looked up by [`ArgMaxKernel`]; one launch per call on the compute stream (a
//! 1024-thread block per row, grid-stride over rows), into the executor's output.

use cudarc::driver::{LaunchConfig, PushKernelArg};
use oxiflow_cuda::{device_error, launched, CudaKernels, CudaSource};
use oxiflow_dtype::DType;
use oxiflow_tensor::{ExternOp, KernelIo, Result};

use super::ArgMax;

/// The kernels of `argmax.cu`, by input element type.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
struct ArgMaxKernel(DType);

oxiflow_cuda::kernel_ids!(ArgMaxKernel([F32, F64, BF16, F16]) => "argmax");

static SOURCE: CudaSource<ArgMaxKernel> = CudaSource::new("argmax", include_str!("argmax.cu"));

pub(super) fn argmax(op: &ArgMax, b: &CudaKernels, io: KernelIo<'_, CudaKernels>) -> Result<()> {
    let name = op.name();
    let ([x], [y]) = (io.inputs, &*io.outputs) else {
        return Err(device_error(name, "expects 1 input and 1 output"));
    };
    let n = x.shape().dims().last().copied().unwrap_or(0);
    let rows = y.numel();
    if y.dtype() != DType::I64 || n == 0 || x.numel() != rows * n {
        return Err(device_error(
            name,
            format!(
                "input {} {} and output {} {} are not rows of a last dim and their indices",
                x.dtype(),
                x.shape(),
                y.dtype(),
                y.shape()
            ),
        ));
    }
    if rows == 0 {
        return Ok(());
    }
    let rt = b.runtime();
    let f = SOURCE.function(rt, name, ArgMaxKernel(x.dtype()))?;
    let (xp, yp, r, nn) = (x.ptr(), y.ptr(), rows as i64, n as i64);
    let mut l = rt.launcher(name, f)?;
    l.arg(&xp).arg(&yp).arg(&r).arg(&nn);
    let cfg = LaunchConfig {
        grid_dim: (rows.clamp(1, 1 << 20) as u32, 1, 1),
        block_dim: (1024, 1, 1),
        shared_mem_bytes: 0,
    };
    // SAFETY: argmax_<dtype> takes (const T*, i64*, i64 rows, i64 n); x holds rows * n elements
    // of its dtype and y rows i64 (checked above); the pieces outlive the launch.
    launched(name, unsafe { l.launch(cfg) })
}
