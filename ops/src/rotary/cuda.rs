//! The rotary embedding's CUDA kernel (`rotary.cu`, the library's NVRTC path): one grid-stride
//! launch per call on the compute stream, into the executor's output buffer.

use cudarc::driver::PushKernelArg;
use oxiflow_cuda::kernel_layer::grid;
use oxiflow_cuda::{device_error, launched, CudaKernels, CudaSource};
use oxiflow_dtype::DType;
use oxiflow_tensor::{ExternOp, KernelIo, Result};

use super::RotaryTables;

/// The kernel of `rotary.cu` for an element type.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
struct RotaryKernel(DType);

oxiflow_cuda::kernel_ids!(RotaryKernel([F32, F64, BF16, F16]) => "rotary_tables");

static SOURCE: CudaSource<RotaryKernel> = CudaSource::new("rotary", include_str!("rotary.cu"));

pub(super) fn rotate(
    op: &RotaryTables,
    b: &CudaKernels,
    io: KernelIo<'_, CudaKernels>,
) -> Result<()> {
    let name = op.name();
    let ([x, c, s], [y]) = (io.inputs, &*io.outputs) else {
        return Err(device_error(name, "expects x, cos, sin and 1 output"));
    };
    let dtype = x.dtype();
    let (&[_, t, h, d], table) = (x.shape().dims(), c.shape().dims()) else {
        return Err(device_error(
            name,
            format!("x is {}, not [B, T, H, D]", x.shape()),
        ));
    };
    let fits = table == [t, 1, d]
        && s.shape().dims() == table
        && y.shape() == x.shape()
        && [c, s].iter().all(|p| p.dtype() == dtype)
        && y.dtype() == dtype
        && d % 2 == 0;
    if !fits {
        return Err(device_error(
            name,
            format!(
                "x {dtype} {} with tables {} {} and {} {} into {} {}",
                x.shape(),
                c.dtype(),
                c.shape(),
                s.dtype(),
                s.shape(),
                y.dtype(),
                y.shape()
            ),
        ));
    }
    let n = x.numel();
    if n == 0 {
        return Ok(());
    }
    if n > (u32::MAX / 2) as usize {
        return Err(device_error(name, format!("{n} elements (at most 2^31)")));
    }
    let rt = b.runtime();
    let f = SOURCE.function(rt, name, RotaryKernel(dtype))?;
    let (xp, cp, sp, yp) = (x.ptr(), c.ptr(), s.ptr(), y.ptr());
    let sizes = [n as i64, t as i64, h as i64, d as i64];
    let inv = i32::from(op.inverse);
    let mut l = rt.launcher(name, f)?;
    l.arg(&xp).arg(&cp).arg(&sp).arg(&yp);
    for v in &sizes {
        l.arg(v);
    }
    l.arg(&inv);
    // SAFETY: rotary_tables_<dtype> takes (const T*, const T*, const T*, T*, i64 n, i64 t,
    // i64 h, i64 d, int); x and y hold n = B T H D elements of T and the tables T D each
    // (checked above); every buffer outlives the launch on the stream.
    launched(name, unsafe { l.launch(grid(n)) })
}
