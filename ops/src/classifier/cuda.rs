//! Fused classifier CUDA kernels: the raw layer's fused classifier (softmax over the class
//! columns from one read of each row where it fits a block; the loss and `softmax - onehot`
//! written to their own buffers, the padded columns' gradient 0) and its row scaling; f64
//! logits take the composed kernels.

use crate::kernel_io::io_arrays;
use oxiflow_cuda::kernel_layer::{
    classifier, last_dim_rows, row_scale, Classifier as RawClassifier, FloatType, RowScale,
};
use oxiflow_cuda::{device_error as derr, CudaKernels, CudaStorage};
use oxiflow_dtype::DType;
use oxiflow_tensor::{KernelIo, Result};

use super::{Classifier, ClassifierGrad, Composed};

/// [loss, dlogits] of logits and targets into the executor's buffers.
pub(super) fn forward(
    op: &Classifier,
    cu: &CudaKernels,
    io: KernelIo<'_, CudaKernels>,
) -> Result<()> {
    let ([logits, targets], [loss, dlogits]) = io_arrays("classifier", io.inputs, io.outputs)?;
    cuda_classify(cu, logits, targets, op.classes, [loss, dlogits])
}

/// The fused classifier over the first `classes` columns of `logits` into [loss, dlogits]
/// (the composed kernels for f64).
pub(crate) fn cuda_classify(
    cu: &CudaKernels,
    logits: &CudaStorage,
    targets: &CudaStorage,
    classes: usize,
    [loss, dlogits]: [&mut CudaStorage; 2],
) -> Result<()> {
    let op = "classifier";
    let (rows, v) = last_dim_rows(logits);
    if targets.dtype() != DType::I64
        || !(1..=v).contains(&classes)
        || targets.numel() != rows
        || loss.numel() != rows
        || dlogits.numel() != logits.numel()
        || dlogits.dtype() != logits.dtype()
    {
        return Err(derr(
            op,
            format!(
                "targets {} {}, loss {} and dlogits {} {} for logits {} {} of {classes} classes",
                targets.dtype(),
                targets.shape(),
                loss.shape(),
                dlogits.dtype(),
                dlogits.shape(),
                logits.dtype(),
                logits.shape()
            ),
        ));
    }
    if rows == 0 {
        return Ok(());
    }
    match FloatType::of(logits.dtype()) {
        Some(dtype) if loss.dtype() == DType::F32 => {
            let at = [logits.ptr(), targets.ptr(), loss.ptr()];
            launch_classifier(cu, dtype, (rows, classes, v), at, Some(dlogits.ptr()))
        }
        _ => Composed::forward(cu, logits, targets, classes, [loss, dlogits]),
    }
}

/// The raw layer's fused classifier of `rows` rows of `width` logits of `dtype` at device
/// addresses [logits, targets, loss] over their first `classes` columns, for a unit incoming
/// gradient (targets checked): each row's loss, and `softmax - onehot` written to `dlogits`
/// (or over the logits when None).
pub(crate) fn launch_classifier(
    cu: &CudaKernels,
    dtype: FloatType,
    (rows, classes, width): (usize, usize, usize),
    [logits, targets, loss]: [u64; 3],
    dlogits: Option<u64>,
) -> Result<()> {
    let args = RawClassifier {
        rows,
        v: classes,
        ld: width,
        dloss: 1.0,
        dtype,
        logits,
        targets,
        loss,
        dlogits,
        strict: true,
    };
    Ok(classifier(cu.runtime(), &args)?)
}

/// The raw layer's row scaling of `rows` rows of `cols` elements of `dtype` at device
/// addresses [x, scale, y]: `y` row i = `x` row i times `scale[i]`.
pub(crate) fn launch_row_scale(
    cu: &CudaKernels,
    dtype: FloatType,
    (rows, cols): (usize, usize),
    [x, scale, y]: [u64; 3],
) -> Result<()> {
    let args = RowScale {
        rows,
        cols,
        dtype,
        x,
        scale,
        y,
    };
    Ok(row_scale(cu.runtime(), &args)?)
}

/// dlogits scaled by dloss row by row into the executor's buffer.
pub(super) fn backward(
    _op: &ClassifierGrad,
    cu: &CudaKernels,
    io: KernelIo<'_, CudaKernels>,
) -> Result<()> {
    let op = "classifier_backward";
    let ([dlogits, dloss], [out]) = io_arrays(op, io.inputs, io.outputs)?;
    let (rows, cols) = last_dim_rows(dlogits);
    if dloss.numel() != rows || out.numel() != dlogits.numel() || out.dtype() != dlogits.dtype() {
        return Err(derr(
            op,
            format!(
                "dloss {} and output {} {} for dlogits {} {}",
                dloss.shape(),
                out.dtype(),
                out.shape(),
                dlogits.dtype(),
                dlogits.shape()
            ),
        ));
    }
    if rows == 0 || cols == 0 {
        return Ok(());
    }
    match FloatType::of(dlogits.dtype()) {
        Some(dtype) if dloss.dtype() == DType::F32 => {
            let at = [dlogits.ptr(), dloss.ptr(), out.ptr()];
            launch_row_scale(cu, dtype, (rows, cols), at)
        }
        _ => Composed::backward(cu, dlogits, dloss, out),
    }
}
