//! SwiGLU's CUDA kernels (`swiglu.cu`), compiled once per process through the library's NVRTC
//! path and looked up by [`SwiGluKernel`]; one grid-stride launch per call on the compute
//! stream, into the executor's output buffers.

use cudarc::driver::PushKernelArg;
use oxiflow_cuda::kernel_layer::grid;
use oxiflow_cuda::{device_error, launched, CudaKernels, CudaRuntime, CudaSource, CudaStorage};
use oxiflow_dtype::DType;
use oxiflow_tensor::{ExternOp, KernelIo, Result};

use super::{SwiGlu, SwiGluGrad, SwiGluPairs};

/// The kernels of `swiglu.cu`: forward, backward or packed forward, and element type.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum SwiGluKernel {
    Forward(DType),
    Backward(DType),
    Pairs(DType),
}

oxiflow_cuda::kernel_ids!(SwiGluKernel {
    [F32, F64, BF16, F16] {
        Forward => "swiglu_fwd",
        Backward => "swiglu_bwd",
        Pairs => "swiglu_pairs",
    },
});

static SOURCE: CudaSource<SwiGluKernel> = CudaSource::new("swiglu", include_str!("swiglu.cu"));

/// A typed error unless every piece holds `n` elements of `dtype`.
fn same(op: &'static str, pieces: &[&CudaStorage], n: usize, dtype: DType) -> Result<()> {
    match pieces.iter().find(|p| p.numel() != n || p.dtype() != dtype) {
        Some(p) => Err(device_error(
            op,
            format!(
                "a piece of {} {} among operands of {n} {dtype} elements",
                p.dtype(),
                p.shape()
            ),
        )),
        None => Ok(()),
    }
}

pub(super) fn forward(op: &SwiGlu, b: &CudaKernels, io: KernelIo<'_, CudaKernels>) -> Result<()> {
    let name = op.name();
    let ([g, u], [y]) = (io.inputs, &*io.outputs) else {
        return Err(device_error(name, "expects 2 inputs and 1 output"));
    };
    let (n, dtype) = (g.numel(), g.dtype());
    same(name, &[g, u, y], n, dtype)?;
    forward_at(b.runtime(), name, dtype, (g.ptr(), u.ptr(), y.ptr()), n)
}

/// `y = silu(g) * u` over `n` elements of `dtype` at device addresses (g, u, y); `y` may be
/// `g` or `u` (each element is read before it is written).
pub(crate) fn forward_at(
    rt: &CudaRuntime,
    name: &'static str,
    dtype: DType,
    (gp, up, yp): (u64, u64, u64),
    n: usize,
) -> Result<()> {
    if n == 0 {
        return Ok(());
    }
    let f = SOURCE.function(rt, name, SwiGluKernel::Forward(dtype))?;
    let count = n as i64;
    let mut l = rt.launcher(name, f)?;
    l.arg(&gp).arg(&up).arg(&yp).arg(&count);
    // SAFETY: swiglu_fwd_<dtype> takes (const T*, const T*, T*, i64); the callers' three
    // buffers hold `n` elements of `dtype` each and stay alive until the stream runs it.
    launched(name, unsafe { l.launch(grid(n)) })
}

pub(super) fn backward(
    op: &SwiGluGrad,
    b: &CudaKernels,
    io: KernelIo<'_, CudaKernels>,
) -> Result<()> {
    let name = op.name();
    let ([g, u, dy], [dg, du]) = (io.inputs, &*io.outputs) else {
        return Err(device_error(name, "expects 3 inputs and 2 outputs"));
    };
    let (n, dtype) = (g.numel(), g.dtype());
    same(name, &[g, u, dy, dg, du], n, dtype)?;
    backward_at(
        b.runtime(),
        name,
        dtype,
        (g.ptr(), u.ptr(), dy.ptr()),
        (dg.ptr(), du.ptr()),
        n,
    )
}

/// `(dg, du)` of `y = silu(g) * u` given `dy`, over `n` elements of `dtype` at device
/// addresses; `dg` may be `g` and `du` may be `u` (each element is read before it is written).
pub(crate) fn backward_at(
    rt: &CudaRuntime,
    name: &'static str,
    dtype: DType,
    (gp, up, dyp): (u64, u64, u64),
    (dgp, dup): (u64, u64),
    n: usize,
) -> Result<()> {
    if n == 0 {
        return Ok(());
    }
    let f = SOURCE.function(rt, name, SwiGluKernel::Backward(dtype))?;
    let count = n as i64;
    let mut l = rt.launcher(name, f)?;
    l.arg(&gp)
        .arg(&up)
        .arg(&dyp)
        .arg(&dgp)
        .arg(&dup)
        .arg(&count);
    // SAFETY: swiglu_bwd_<dtype> takes (const T*, const T*, const T*, T*, T*, i64); the
    // callers' five buffers hold `n` elements of `dtype` each and outlive the launch.
    launched(name, unsafe { l.launch(grid(n)) })
}

pub(super) fn pairs(
    op: &SwiGluPairs,
    b: &CudaKernels,
    io: KernelIo<'_, CudaKernels>,
) -> Result<()> {
    let name = op.name();
    let ([x], [y]) = (io.inputs, &*io.outputs) else {
        return Err(device_error(name, "expects 1 input and 1 output"));
    };
    let dtype = x.dtype();
    if x.numel() % 2 != 0 {
        return Err(device_error(
            name,
            format!("x {} is no (gate, up) pairs", x.shape()),
        ));
    }
    let n = x.numel() / 2;
    same(name, &[y], n, dtype)?;
    if n == 0 {
        return Ok(());
    }
    let rt = b.runtime();
    let func = SOURCE.function(rt, name, SwiGluKernel::Pairs(dtype))?;
    let (xp, yp, count) = (x.ptr(), y.ptr(), n as i64);
    let mut l = rt.launcher(name, func)?;
    l.arg(&xp).arg(&yp).arg(&count);
    // SAFETY: swiglu_pairs_<dtype> takes (const T*, T*, i64 n); x holds 2 n elements of
    // `dtype` and y n (checked above); the pieces outlive the launch.
    launched(name, unsafe { l.launch(grid(n)) })
}
