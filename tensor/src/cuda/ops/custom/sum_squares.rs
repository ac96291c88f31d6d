//! Multi-tensor sum of squares CUDA kernel: the raw layer's two launches over every input
//! (f32, bf16, f16 and f64 alike), written to the executor's f64 buffers.

use oxiflow_dtype::DType;

use crate::cuda::ops::CudaKernels;
use crate::cuda::storage::CudaStorage;
use crate::cuda::sum_squares::{sum_squares, SumElem, SumEntry};
use crate::op::custom::{SumSquares, SumSquaresKernels, SumTerm};
use crate::op::{kernel_err, OpFamily};
use crate::Result;

impl SumSquaresKernels for CudaKernels {
    fn sum_squares(
        &self,
        op: &SumSquares,
        x: &[&CudaStorage],
        out: &mut [CudaStorage],
    ) -> Result<()> {
        let mut list = Vec::with_capacity(x.len());
        for (i, p) in x.iter().enumerate() {
            let elem = match p.dtype {
                DType::F32 => SumElem::F32,
                DType::BF16 => SumElem::Bf16,
                DType::F16 => SumElem::F16,
                DType::F64 => SumElem::F64,
                d => {
                    return Err(kernel_err(
                        op.name(),
                        format!("input {i} is {d}, not a float dtype"),
                    ))
                }
            };
            let n = p.numel();
            list.push(SumEntry::new(if n == 0 { 0 } else { p.ptr() }, n, elem));
        }
        let [each, total] = out else {
            return Err(kernel_err(
                op.name(),
                format!("expects 2 output buffers, got {}", out.len()),
            ));
        };
        let f64s = each.dtype == DType::F64 && total.dtype == DType::F64;
        if !f64s || each.numel() != x.len() || total.numel() != 1 {
            return Err(kernel_err(
                op.name(),
                format!(
                    "{} inputs need f64 outputs [{}] and [], got {} {} and {} {}",
                    x.len(),
                    x.len(),
                    each.dtype,
                    each.shape,
                    total.dtype,
                    total.shape
                ),
            ));
        }
        let zeroed = op.term == SumTerm::TimesZero;
        Ok(sum_squares(
            &self.rt,
            &list,
            zeroed,
            each.ptr(),
            total.ptr(),
        )?)
    }
}
