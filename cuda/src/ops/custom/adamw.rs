//! Fused AdamW CUDA kernel (one element-wise launch per pass), written into the executor's
//! output piece.

use crate::derr;
use crate::kernels::{grid, launch, Template};
use crate::ops::{float_only, CudaKernels};
use crate::storage::CudaStorage;
use oxiflow_tensor::backend::OpFamily;
use oxiflow_tensor::custom::{AdamPart, AdamWKernels};
use oxiflow_tensor::Result;

impl AdamWKernels for CudaKernels {
    fn adam(&self, part: AdamPart, x: &[&CudaStorage], out: &mut CudaStorage) -> Result<()> {
        let (rt, name) = (&self.rt, part.name());
        let dt = out.dtype;
        float_only(name, dt)?;
        let n = out.shape.numel();
        let want = part.operands();
        if x.len() != want || x.iter().any(|p| p.dtype != dt || p.numel() != n) {
            return Err(derr(
                name,
                format!(
                    "needs {want} {dt} pieces of {} elements, got {:?}",
                    n,
                    x.iter().map(|p| (p.dtype, p.numel())).collect::<Vec<_>>()
                ),
            ));
        }
        let code: i32 = match part {
            AdamPart::Moment1 { .. } => 0,
            AdamPart::Moment2 { .. } => 1,
            AdamPart::Update { .. } => 2,
        };
        let [a, b, c, d] = part.coefficients();
        let (nn, xp, yp, zp, op) = (
            n as i64,
            x[0].ptr(),
            x[1].ptr(),
            x[want - 1].ptr(),
            out.ptr(),
        );
        if n > 0 {
            launch!(rt, name, Template::Adam.at(dt), grid(n); nn, code, a, b, c, d, xp, yp, zp, op)?;
        }
        Ok(())
    }
}
