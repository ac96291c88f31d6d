//! Softmax CUDA kernels, written into the executor's output piece: softmax / log-softmax over one dim and their backward, one block per
//! row over the last dim, else one thread per lane. When its output feeds bf16 products (the op
//! says) the row backward also writes the output's bf16 copy (attention's dS feeds two).

use oxiflow_dtype::DType;

use super::super::kernels::{launch, per_row, Kernel, Template};
use super::super::storage::CudaStorage;
use super::super::{Block, MatmulPrecision};
use super::{fits, float_only, lanes, CudaKernels};
use oxiflow_tensor::backend::SoftmaxKernels;
use oxiflow_tensor::Result;

impl SoftmaxKernels for CudaKernels {
    fn softmax(&self, a: &CudaStorage, dim: usize, log: bool, out: &mut CudaStorage) -> Result<()> {
        let (rt, name) = (&self.rt, if log { "log_softmax" } else { "softmax" });
        let dt = a.dtype;
        float_only(name, dt)?;
        fits(name, a, out, true)?;
        let (o, len, inner) = lanes(&a.shape, dim);
        let y = &*out;
        let (l, nn, inn, lg, xp, yp) = (
            (o * inner) as i64,
            len as i64,
            inner as i64,
            log as i32,
            a.ptr(),
            y.ptr(),
        );
        if o * inner > 0 {
            launch!(rt, name, Template::Softmax.at(dt), per_row(o * inner); l, nn, inn, lg, xp, yp)?;
        }
        Ok(())
    }

    fn softmax_backward(
        &self,
        yv: &CudaStorage,
        dy: &CudaStorage,
        dim: usize,
        log: bool,
        feeds: MatmulPrecision,
        out: &mut CudaStorage,
    ) -> Result<()> {
        let rt = &self.rt;
        let name = if log {
            "log_softmax_backward"
        } else {
            "softmax_backward"
        };
        let dt = yv.dtype;
        float_only(name, dt)?;
        fits(name, yv, out, true)?;
        fits(name, dy, out, true)?;
        let (o, len, inner) = lanes(&yv.shape, dim);
        let y = &*out;
        let lg = log as i32;
        let (l, nn, inn, yp, gp, dp) = (
            (o * inner) as i64,
            len as i64,
            inner as i64,
            yv.ptr(),
            dy.ptr(),
            y.ptr(),
        );
        if o * inner > 0 {
            if dt == DType::F32 && inner == 1 && !log && feeds == MatmulPrecision::Bf16 {
                // Row gradients (attention's dS) feed bf16 products: their bf16 copy comes along.
                let h = Block::alloc(rt, y.numel() * 2)?;
                let hp = h.ptr();
                launch!(rt, name, Kernel::SoftmaxBwRowsBf16, per_row(o); l, nn, yp, gp, dp, hp)?;
                y.block.set_bf16_shadow(h);
            } else {
                launch!(rt, name, Template::SoftmaxBw.at(dt), per_row(o * inner); l, nn, inn, lg, yp, gp, dp)?;
            }
        }
        Ok(())
    }
}
