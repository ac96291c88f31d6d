//! Fused classifier CUDA kernels: the raw layer's fused classifier (softmax over the class
//! columns from one read of each row where it fits a block; the loss and `softmax - onehot`
//! written to their own buffers, the padded columns' gradient 0) and its row scaling; f64
//! logits take the composed kernels.

use oxiflow_dtype::DType;

use crate::derr;
use crate::fused::{classifier, row_scale, RowScale};
use crate::ops::{last_dim_rows, CudaKernels};
use crate::raw::Classifier;
use crate::raw::FloatType;
use crate::storage::CudaStorage;
use oxiflow_tensor::custom::{ClassifierKernels, ClassifierOp};
use oxiflow_tensor::Result;

impl ClassifierKernels for CudaKernels {
    fn classifier(
        &self,
        logits: &CudaStorage,
        targets: &CudaStorage,
        classes: usize,
        out: [&mut CudaStorage; 2],
    ) -> Result<()> {
        let op = "classifier";
        let [loss, dlogits] = out;
        let (rows, v) = last_dim_rows(logits);
        if targets.dtype != DType::I64
            || !(1..=v).contains(&classes)
            || targets.numel() != rows
            || loss.numel() != rows
            || dlogits.numel() != logits.numel()
            || dlogits.dtype != logits.dtype
        {
            return Err(derr(
                op,
                format!(
                    "targets {} {}, loss {} and dlogits {} {} for logits {} {} of {classes} classes",
                    targets.dtype,
                    targets.shape,
                    loss.shape,
                    dlogits.dtype,
                    dlogits.shape,
                    logits.dtype,
                    logits.shape
                ),
            ));
        }
        if rows == 0 {
            return Ok(());
        }
        match FloatType::of(logits.dtype) {
            Some(dtype) if loss.dtype == DType::F32 => {
                let args = Classifier {
                    rows,
                    v: classes,
                    ld: v,
                    dloss: 1.0,
                    dtype,
                    logits: logits.ptr(),
                    targets: targets.ptr(),
                    loss: loss.ptr(),
                    dlogits: Some(dlogits.ptr()),
                    strict: true,
                };
                Ok(classifier(&self.rt, &args)?)
            }
            _ => ClassifierOp::composed_forward(self, logits, targets, classes, [loss, dlogits]),
        }
    }

    fn classifier_backward(
        &self,
        dlogits: &CudaStorage,
        dloss: &CudaStorage,
        out: &mut CudaStorage,
    ) -> Result<()> {
        let op = "classifier_backward";
        let (rows, cols) = last_dim_rows(dlogits);
        if dloss.numel() != rows || out.numel() != dlogits.numel() || out.dtype != dlogits.dtype {
            return Err(derr(
                op,
                format!(
                    "dloss {} and output {} {} for dlogits {} {}",
                    dloss.shape, out.dtype, out.shape, dlogits.dtype, dlogits.shape
                ),
            ));
        }
        if rows == 0 || cols == 0 {
            return Ok(());
        }
        match FloatType::of(dlogits.dtype) {
            Some(dtype) if dloss.dtype == DType::F32 => {
                let args = RowScale {
                    rows,
                    cols,
                    dtype,
                    x: dlogits.ptr(),
                    scale: dloss.ptr(),
                    y: out.ptr(),
                };
                Ok(row_scale(&self.rt, &args)?)
            }
            _ => ClassifierOp::composed_backward(self, dlogits, dloss, out),
        }
    }
}
