//! Fused linear cross-entropy CUDA kernels: the rows in chunks of at most
//! [`CHUNK_BYTES`] of logits; per chunk one cuBLASLt product into a scratch buffer, the
//! one-pass classifier turning it into the logits' gradient in place (the rows' losses beside
//! it), and two products writing the chunk's rows of `dx` and adding its share of `dw` to an
//! f32 accumulator (the table's gradient itself for f32 data); then the rows' losses summed.
//! The backward scales both gradients by dloss with the row-scaling kernel (each piece one
//! row). f64 data, empty pieces and products cuBLASLt refuses take the composed kernels.

use oxiflow_dtype::DType;
use oxiflow_sbp::Shape;

use crate::kernel_io::io_arrays;
use oxiflow_cuda::kernel_layer::{FloatType, LtMatmul};
use oxiflow_cuda::{device_error as derr, CudaKernels};
use oxiflow_tensor::backend::{ElementwiseKernels, ReductionKernels};
use oxiflow_tensor::{KernelBackend, KernelIo, OutSpec, Result};

use super::{Composed, LinearClassifier, LinearClassifierGrad, CHUNK_BYTES};
use crate::classifier::{cuda_classify, launch_classifier, launch_row_scale};

/// Rows per chunk for `n` rows of `v` logits of `size` bytes: as few chunks as
/// [`CHUNK_BYTES`] allows, of equal size.
fn chunk_rows(n: usize, v: usize, size: usize) -> usize {
    let most = (CHUNK_BYTES / (v * size).max(1)).max(1);
    let chunks = n.div_ceil(most).max(1);
    n.div_ceil(chunks)
}

/// [loss, dx, dw] of x, the table and targets into the executor's buffers.
pub(super) fn forward(
    op: &LinearClassifier,
    cu: &CudaKernels,
    io: KernelIo<'_, CudaKernels>,
) -> Result<()> {
    let (classes, precision) = (op.classes, op.precision);
    let op = "linear_classifier";
    let ([x, w, targets], [loss, dx, dw]) = io_arrays(op, io.inputs, io.outputs)?;
    let (n, c, v) = match (x.shape().dims(), w.shape().dims()) {
        ([n, c], [v, wc]) if c == wc => (*n, *c, *v),
        _ => return Err(derr(op, format!("x {} and table {}", x.shape(), w.shape()))),
    };
    if w.dtype() != x.dtype()
        || dx.dtype() != x.dtype()
        || dw.dtype() != x.dtype()
        || targets.dtype() != DType::I64
        || targets.numel() != n
        || dx.numel() != n * c
        || dw.numel() != v * c
        || loss.numel() != 1
        || !(1..=v).contains(&classes)
    {
        return Err(derr(
                op,
                format!(
                    "x {} {}, table {} {}, targets {} {}, outputs {} {}, {} {}, {} {} for {classes} classes",
                    x.dtype(), x.shape(), w.dtype(), w.shape(), targets.dtype(), targets.shape(),
                    loss.dtype(), loss.shape(), dx.dtype(), dx.shape(), dw.dtype(), dw.shape()
                ),
            ));
    }
    let attrs = (classes, precision);
    let t = match cu.lt_types(x.dtype(), precision) {
        Some(t) if n > 0 && c > 0 && loss.dtype() == DType::F32 => t,
        _ => return Composed::forward(cu, x, w, targets, attrs, [loss, dx, dw], cuda_classify),
    };
    let dtype = t.0;
    let size = dtype.size();
    let rows_per = chunk_rows(n, v, size);
    let logits = cu.alloc(&OutSpec {
        shape: Shape::new([rows_per, v]),
        dtype: x.dtype(),
    })?;
    let row_loss = cu.alloc(&OutSpec {
        shape: Shape::new([n]),
        dtype: DType::F32,
    })?;
    // dw's sums in f32: dw itself for f32 data, else a scratch cast into it at the end.
    let acc = match dtype {
        FloatType::F32 => None,
        _ => Some(cu.alloc(&OutSpec {
            shape: Shape::new([v, c]),
            dtype: DType::F32,
        })?),
    };
    let acc_ptr = acc.as_ref().map_or(dw.ptr(), |a| a.ptr());
    let mut r0 = 0;
    while r0 < n {
        let rows = rows_per.min(n - r0);
        let xc = x.ptr() + (r0 * c * size) as u64;
        // logits [rows, v] = x_c w^T.
        let g = LtMatmul::new((rows, v, c), (false, true), t);
        if !cu.lt_ran(&g, xc, w.ptr(), logits.ptr())? {
            return Composed::forward(cu, x, w, targets, attrs, [loss, dx, dw], cuda_classify);
        }
        let at = [
            logits.ptr(),
            targets.ptr() + (r0 * 8) as u64,
            row_loss.ptr() + (r0 * 4) as u64,
        ];
        launch_classifier(cu, dtype, (rows, classes, v), at, None)?;
        // dx rows [rows, c] = D_c w; dw [v, c] (+)= D_c^T x_c.
        let gx = LtMatmul::new((rows, c, v), (false, false), t);
        let dxc = dx.ptr() + (r0 * c * size) as u64;
        let beta = if r0 == 0 { 0.0 } else { 1.0 };
        let gw = LtMatmul {
            out_type: FloatType::F32,
            beta,
            ..LtMatmul::new((v, c, rows), (true, false), t)
        };
        if !cu.lt_ran(&gx, logits.ptr(), w.ptr(), dxc)?
            || !cu.lt_ran(&gw, logits.ptr(), xc, acc_ptr)?
        {
            return Composed::forward(cu, x, w, targets, attrs, [loss, dx, dw], cuda_classify);
        }
        r0 += rows;
    }
    drop(logits);
    if let Some(acc) = acc {
        cu.cast(&acc, dw)?;
    }
    cu.sum_to_shape(&row_loss, loss)
}

/// dx and dw times dloss into the executor's buffers.
pub(super) fn backward(
    _op: &LinearClassifierGrad,
    cu: &CudaKernels,
    io: KernelIo<'_, CudaKernels>,
) -> Result<()> {
    let op = "linear_classifier_backward";
    let ([sx, sw, dloss], [ox, ow]) = io_arrays(op, io.inputs, io.outputs)?;
    let (saved, out) = ([sx, sw], [ox, ow]);
    if dloss.numel() != 1
        || saved
            .iter()
            .zip(out.iter())
            .any(|(x, y)| x.numel() != y.numel() || x.dtype() != y.dtype())
    {
        return Err(derr(
            op,
            format!(
                "dloss {} and outputs {:?} for gradients {:?}",
                dloss.shape(),
                out.iter()
                    .map(|o| o.shape().to_string())
                    .collect::<Vec<_>>(),
                saved
                    .iter()
                    .map(|s| s.shape().to_string())
                    .collect::<Vec<_>>()
            ),
        ));
    }
    let one_row = saved.iter().all(|x| x.numel() <= i32::MAX as usize);
    match FloatType::of(saved[0].dtype()) {
        Some(dtype) if dloss.dtype() == DType::F32 && one_row => {
            for (x, y) in saved.into_iter().zip(out) {
                // The whole piece as one row scaled by dloss's value.
                launch_row_scale(cu, dtype, (1, x.numel()), [x.ptr(), dloss.ptr(), y.ptr()])?;
            }
            Ok(())
        }
        _ => Composed::backward(cu, saved, dloss, out),
    }
}
