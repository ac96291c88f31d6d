//! Dropout on CUDA, written into the executor's output piece: one kernel computing each element's global index from the piece's region
//! and its keep decision from the device Philox (`rng::uniform`'s bits), so the mask equals the
//! CPU kernel's.

use super::super::derr;
use super::super::kernels::{grid, launch, strides, Nd, Template};
use super::super::storage::CudaStorage;
use super::{float_only, CudaKernels};
use oxiflow_tensor::backend::DropoutKernels;
use oxiflow_tensor::DropoutOp;
use oxiflow_tensor::Result;

impl DropoutKernels for CudaKernels {
    fn dropout(&self, x: &CudaStorage, op: &DropoutOp, out: &mut CudaStorage) -> Result<()> {
        let (rt, name) = (&self.rt, "dropout");
        float_only(name, x.dtype)?;
        let extents = x.shape.dims();
        op.check_piece(extents)?;
        if out.shape != x.shape || out.dtype != x.dtype {
            return Err(derr(
                name,
                format!(
                    "output {} {} for input {} {}",
                    out.dtype, out.shape, x.dtype, x.shape
                ),
            ));
        }
        let y = &*out;
        let n = x.numel();
        if n == 0 {
            return Ok(());
        }
        // check_piece bounds the global element count, so these fit an i64.
        let gst: Vec<i64> = op.global.strides().iter().map(|&s| s as i64).collect();
        let base: i64 = op
            .starts
            .iter()
            .zip(&gst)
            .map(|(&s, &g)| s as i64 * g)
            .sum();
        let p = Nd::new(extents, &gst, &strides(extents))
            .ok_or_else(|| derr(name, format!("piece {} has too many dims", x.shape)))?;
        let (nn, pd, sc) = (n as i64, op.p.get(), op.keep_scale());
        let (k0, k1, xp, yp) = (op.seed as u32, (op.seed >> 32) as u32, x.ptr(), y.ptr());
        launch!(rt, name, Template::Dropout.at(x.dtype), grid(n); nn, pd, sc, k0, k1, base, p, xp, yp)?;
        Ok(())
    }
}
