//! Fused MLP CUDA kernels: the forward is the linear layer's GELU product (bias and GELU in its
//! epilogue, the pre-activation saved) and one cuBLASLt product `h w_proj + b_proj + residual`
//! (bias in the epilogue, the residual read as the C operand); the backward is one product
//! `dy w_proj^T` whose epilogue applies GELU's derivative at the saved pre-activation, the
//! projection's weight gradient, `dpre w_fc^T`, and w_fc's gradient with b_fc's in its
//! epilogue. f64 data, empty pieces and calls cuBLASLt refuses take the composed kernels.

use oxiflow_cuda::kernel_layer::{Epilogue, LtMatmul};
use oxiflow_cuda::{device_error as derr, CudaKernels, CudaStorage};
use oxiflow_dtype::MatmulPrecision;
use oxiflow_tensor::backend::MatmulKernels;
use oxiflow_tensor::{KernelBackend, OutSpec, Result};

use super::{Composed, ResidualMlpKernels};
use crate::linear::{Activation, LinearKernels};

/// The (rows, C, F) of an MLP on `x` `[.., C]` with `w_fc` `[C, F]` (`ins[0]` and `ins[w]`),
/// every input and output piece of one dtype; else an error of `op` naming the pieces.
fn sizes(
    op: &'static str,
    ins: [&CudaStorage; 6],
    w: usize,
    out: &[CudaStorage],
) -> Result<(usize, usize, usize)> {
    let (x, w_fc) = (ins[0], ins[w]);
    let all: Vec<&CudaStorage> = ins.into_iter().chain(out).collect();
    let c = x.shape().dims().last().copied().unwrap_or(0);
    let f = match w_fc.shape().dims() {
        [wc, f] if *wc == c => *f,
        _ => 0,
    };
    if all.iter().any(|p| p.dtype() != x.dtype()) || f == 0 && w_fc.numel() != 0 {
        return Err(derr(
            op,
            format!(
                "pieces {:?} do not make an MLP",
                all.iter()
                    .map(|p| format!("{} {}", p.dtype(), p.shape()))
                    .collect::<Vec<_>>()
            ),
        ));
    }
    Ok((x.numel().checked_div(c).unwrap_or(0), c, f))
}

impl ResidualMlpKernels for CudaKernels {
    fn residual_mlp(
        &self,
        x: [&CudaStorage; 6],
        precision: MatmulPrecision,
        out: &mut [CudaStorage],
    ) -> Result<()> {
        let op = "residual_mlp";
        let [xi, w_fc, b_fc, w_proj, b_proj, res] = x;
        let (rows, c, f) = sizes(op, x, 1, out)?;
        let t = match self.lt_types(xi.dtype(), precision) {
            Some(t) if rows > 0 && c > 0 && f > 0 && out.len() == 3 => t,
            _ => return Composed::forward(self, x, precision, out),
        };
        let gelu = Activation::Gelu;
        self.linear(gelu, precision, xi, w_fc, Some(b_fc), &mut out[1..3])?;
        // y = h w_proj + b_proj + residual.
        let g = LtMatmul {
            beta: 1.0,
            epilogue: Epilogue::Bias { bias: b_proj.ptr() },
            ..LtMatmul::new((rows, c, f), (false, false), t)
        };
        if self.lt_ran_c(&g, out[1].ptr(), w_proj.ptr(), res.ptr(), out[0].ptr())? {
            return Ok(());
        }
        Composed::forward(self, x, precision, out)
    }

    fn residual_mlp_backward(
        &self,
        x: [&CudaStorage; 6],
        precision: MatmulPrecision,
        out: &mut [CudaStorage],
    ) -> Result<()> {
        let op = "residual_mlp_backward";
        let [xi, h, pre, w_fc, w_proj, dy] = x;
        let (rows, c, f) = sizes(op, x, 3, out)?;
        let t = match self.lt_types(xi.dtype(), precision) {
            Some(t) if rows > 0 && c > 0 && f > 0 && f % 8 == 0 && out.len() == 5 => t,
            _ => return Composed::backward(self, x, precision, out),
        };
        let (dx, rest) = out.split_at_mut(1);
        let (fc, proj) = rest.split_at_mut(2);
        // dpre = (dy w_proj^T) gelu'(pre), with b_fc's gradient its column sums.
        let dpre = self.alloc(&OutSpec {
            shape: pre.shape().clone(),
            dtype: pre.dtype(),
        })?;
        // dpre = (dy w_proj^T) gelu'(pre) in the product's epilogue. (cuBLASLt's epilogue that
        // also sums b_fc's gradient ran 1.5 ms slower over GPT-2's 12 layers on an H100 than
        // the weight gradient's bias-gradient epilogue below.)
        let g = LtMatmul {
            epilogue: Epilogue::DGelu { pre: pre.ptr() },
            ..LtMatmul::new((rows, f, c), (false, true), t)
        };
        if !self.lt_ran_c(&g, dy.ptr(), w_proj.ptr(), dpre.ptr(), dpre.ptr())? {
            return Composed::backward(self, x, precision, out);
        }
        self.linear_weight_grad(precision, h, dy, proj)?;
        self.matmul_t(&dpre, w_fc, (false, true), false, precision, &mut dx[0])?;
        self.linear_weight_grad(precision, xi, &dpre, fc)
    }
}
