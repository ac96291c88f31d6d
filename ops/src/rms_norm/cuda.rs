//! RMS normalisation's CUDA kernels (`rms_norm.cu`), compiled once per process through the
//! library's NVRTC path and looked up by [`RmsNormKernel`]; one launch per call on the compute
//! stream (a block per row, grid-stride over rows), into the executor's outputs.

use cudarc::driver::{LaunchConfig, PushKernelArg};
use oxiflow_cuda::{device_error, launched, CudaKernels, CudaSource, CudaStorage};
use oxiflow_dtype::DType;
use oxiflow_tensor::{ExternOp, KernelIo, Result};

use super::{wide, RmsNorm, RmsNormGrad};

/// The kernels of `rms_norm.cu`: direction and element type.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum RmsNormKernel {
    Forward(DType),
    Backward(DType),
}

oxiflow_cuda::kernel_ids!(RmsNormKernel {
    [F32, F64, BF16, F16] { Forward => "rms_norm_fwd", Backward => "rms_norm_bwd" },
});

static SOURCE: CudaSource<RmsNormKernel> = CudaSource::new("rms_norm", include_str!("rms_norm.cu"));

/// One block per row, at most 2^20 blocks (grid-stride beyond): 1024 threads where the rows
/// are too few to fill the device twice over with 256-thread blocks (a decoding step's one
/// row per sequence: the row's loads spread over more threads, fewer in turn on each), else
/// 256.
fn grid(rows: usize) -> LaunchConfig {
    let threads = if rows <= FEW_ROWS { 1024 } else { 256 };
    LaunchConfig {
        grid_dim: (rows.clamp(1, 1 << 20) as u32, 1, 1),
        block_dim: (threads, 1, 1),
        shared_mem_bytes: 0,
    }
}

/// Row counts at or below which a row gets a 1024-thread block.
const FEW_ROWS: usize = 264;

/// (rows, row width) of x against the weight, with every piece's element count and dtype
/// checked: `pieces` are (piece, elements, dtype).
fn geometry(
    op: &'static str,
    x: &CudaStorage,
    w: &CudaStorage,
    pieces: &[(&CudaStorage, usize, DType)],
) -> Result<(usize, usize)> {
    let (n, h) = (x.numel(), w.numel());
    if (h == 0 && n > 0) || (h > 0 && n % h != 0) {
        return Err(device_error(
            op,
            format!("{n} elements are no whole rows of the weight's {h}"),
        ));
    }
    if let Some((p, want, dt)) = pieces
        .iter()
        .find(|(p, want, dt)| p.numel() != *want || p.dtype() != *dt)
    {
        return Err(device_error(
            op,
            format!(
                "a piece of {} {} where {want} {dt} elements belong",
                p.dtype(),
                p.shape()
            ),
        ));
    }
    Ok((n.checked_div(h).unwrap_or(0), h))
}

pub(super) fn forward(op: &RmsNorm, b: &CudaKernels, io: KernelIo<'_, CudaKernels>) -> Result<()> {
    let name = op.name();
    let ([x, w], [y]) = (io.inputs, &*io.outputs) else {
        return Err(device_error(name, "expects 2 inputs and 1 output"));
    };
    let dt = x.dtype();
    let (rows, h) = geometry(name, x, w, &[(w, w.numel(), dt), (y, x.numel(), dt)])?;
    if rows == 0 {
        return Ok(());
    }
    let rt = b.runtime();
    let f = SOURCE.function(rt, name, RmsNormKernel::Forward(dt))?;
    let (xp, wp, yp, r, hh, eps) = (x.ptr(), w.ptr(), y.ptr(), rows as i64, h as i64, op.eps);
    let mut l = rt.launcher(name, f)?;
    l.arg(&xp).arg(&wp).arg(&yp).arg(&r).arg(&hh).arg(&eps);
    // SAFETY: rms_norm_fwd_<dtype> takes (const T*, const T*, T*, i64 rows, i64 h, double);
    // x and y hold rows * h elements of `dt` and w holds h (checked above); the caller keeps
    // the pieces alive until the stream runs the launch.
    launched(name, unsafe { l.launch(grid(rows)) })
}

pub(super) fn backward(
    op: &RmsNormGrad,
    b: &CudaKernels,
    io: KernelIo<'_, CudaKernels>,
) -> Result<()> {
    let name = op.name();
    let ([x, w, dy], [dx, terms]) = (io.inputs, &*io.outputs) else {
        return Err(device_error(name, "expects 3 inputs and 2 outputs"));
    };
    let (dt, n) = (x.dtype(), x.numel());
    let (rows, h) = geometry(
        name,
        x,
        w,
        &[
            (w, w.numel(), dt),
            (dy, n, dt),
            (dx, n, dt),
            (terms, n, wide(dt)),
        ],
    )?;
    if rows == 0 {
        return Ok(());
    }
    let rt = b.runtime();
    let f = SOURCE.function(rt, name, RmsNormKernel::Backward(dt))?;
    let (xp, wp, dyp, dxp, tp) = (x.ptr(), w.ptr(), dy.ptr(), dx.ptr(), terms.ptr());
    let (r, hh, eps) = (rows as i64, h as i64, op.eps);
    let mut l = rt.launcher(name, f)?;
    l.arg(&xp)
        .arg(&wp)
        .arg(&dyp)
        .arg(&dxp)
        .arg(&tp)
        .arg(&r)
        .arg(&hh)
        .arg(&eps);
    // SAFETY: rms_norm_bwd_<dtype> takes (const T*, const T*, const T*, T*, W*, i64, i64,
    // double) with W the wide dtype; x, dy and dx hold rows * h elements of `dt`, terms rows * h
    // of `wide(dt)`, w h of `dt` (checked above); the pieces outlive the launch.
    launched(name, unsafe { l.launch(grid(rows)) })
}
