//! Rotary position embedding CUDA kernel, written into the executor's output piece (one thread
//! per element, f64 angles).

use super::super::derr;
use super::super::kernels::{grid, launch, Template};
use super::super::storage::CudaStorage;
use super::{fits, float_only, CudaKernels};
use oxiflow_tensor::backend::{OpFamily, RotaryKernels};
use oxiflow_tensor::Result;
use oxiflow_tensor::RotaryOp;

impl RotaryKernels for CudaKernels {
    fn rotary(&self, x: &CudaStorage, op: &RotaryOp, out: &mut CudaStorage) -> Result<()> {
        let name = op.name();
        float_only(name, x.dtype)?;
        let dims = x.shape.dims();
        let d = dims.last().copied().unwrap_or(0);
        let Some(&t) = dims.get(op.seq_dim) else {
            return Err(derr(
                name,
                format!("no sequence dim {} in {}", op.seq_dim, x.shape),
            ));
        };
        if !d.is_multiple_of(2) || op.seq_dim + 1 >= dims.len() {
            return Err(derr(name, format!("bad input {}", x.shape)));
        }
        let inner: usize = dims[op.seq_dim + 1..].iter().product();
        fits(name, x, out, true)?;
        let y = &*out;
        let n = y.numel();
        if n > 0 {
            let (nn, dd, tt, inn, p0) =
                (n as i64, d as i64, t as i64, inner as i64, op.pos0 as i64);
            let (base, sign) = (op.base.get(), if op.inverse { -1.0f64 } else { 1.0 });
            let (xp, yp) = (x.ptr(), y.ptr());
            launch!(self.rt, name, Template::Rotary.at(x.dtype), grid(n); nn, dd, tt, inn, p0, base, sign, xp, yp)?;
        }
        Ok(())
    }
}
