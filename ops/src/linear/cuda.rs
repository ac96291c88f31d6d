//! Fused linear layer CUDA kernels: one cuBLASLt product with the bias (and GELU, saving the
//! pre-activation) in its epilogue, and the weight gradient with the bias gradient's row sums
//! in its epilogue, f32 products at the op's precision. f64 data, f32 data at bf16 matmul
//! precision, a GELU without a bias and calls cuBLASLt refuses take the composed kernels.

use oxiflow_cuda::kernel_layer::{fill, Epilogue, LtMatmul};
use oxiflow_cuda::{device_error as derr, CudaKernels, CudaStorage};
use oxiflow_dtype::MatmulPrecision;
use oxiflow_tensor::Result;

use super::{Activation, Composed, LinearKernels};

fn same_dtype(op: &'static str, pieces: &[&CudaStorage]) -> Result<()> {
    let dt = pieces[0].dtype();
    if pieces.iter().any(|p| p.dtype() != dt) {
        return Err(derr(
            op,
            format!(
                "pieces of several dtypes: {:?}",
                pieces.iter().map(|p| p.dtype()).collect::<Vec<_>>()
            ),
        ));
    }
    Ok(())
}

impl LinearKernels for CudaKernels {
    fn linear(
        &self,
        act: Activation,
        precision: MatmulPrecision,
        x: &CudaStorage,
        w: &CudaStorage,
        bias: Option<&CudaStorage>,
        out: &mut [CudaStorage],
    ) -> Result<()> {
        let op = "linear";
        let (k, n) = match w.shape().dims() {
            [k, n] => (*k, *n),
            _ => return Err(derr(op, format!("weight {} is not 2-d", w.shape()))),
        };
        // Rows from x, or from the output when x holds no elements (K = 0).
        let rows = match (k, n) {
            (0, 0) => 0,
            (0, n) => out.first().map_or(0, |o| o.numel() / n),
            (k, _) => x.numel() / k,
        };
        let mut all = vec![x, w];
        all.extend(bias);
        all.extend(out.iter());
        same_dtype(op, &all)?;
        if x.shape().dims().last() != Some(&k)
            || bias.is_some_and(|b| b.numel() != n)
            || out.iter().any(|o| o.numel() != rows * n)
        {
            return Err(derr(
                op,
                format!(
                    "x {}, weight {}, bias {:?} and outputs {:?} do not fit",
                    x.shape(),
                    w.shape(),
                    bias.map(|b| b.shape().to_string()),
                    out.iter()
                        .map(|o| o.shape().to_string())
                        .collect::<Vec<_>>()
                ),
            ));
        }
        if rows == 0 || n == 0 {
            return Ok(());
        }
        if let (Some(t), true) = (self.lt_types(x.dtype(), precision), k > 0) {
            let (y, pre) = match &*out {
                [y] => (y.ptr(), 0),
                [y, pre] => (y.ptr(), pre.ptr()),
                _ => (0, 0),
            };
            let epilogue = match (act, bias) {
                (Activation::None, None) => Some(Epilogue::None),
                (Activation::None, Some(b)) => Some(Epilogue::Bias { bias: b.ptr() }),
                (Activation::Gelu, Some(b)) if pre != 0 => {
                    Some(Epilogue::GeluAuxBias { bias: b.ptr(), pre })
                }
                _ => None,
            };
            if let Some(epilogue) = epilogue {
                let g = LtMatmul {
                    epilogue,
                    ..LtMatmul::new((rows, n, k), (false, false), t)
                };
                if self.lt_ran(&g, x.ptr(), w.ptr(), y)? {
                    return Ok(());
                }
            }
        }
        Composed::forward(self, (act, precision), x, w, bias, out)
    }

    fn linear_weight_grad(
        &self,
        precision: MatmulPrecision,
        x: &CudaStorage,
        dpre: &CudaStorage,
        out: &mut [CudaStorage],
    ) -> Result<()> {
        let op = "linear_weight_grad";
        let k = x.shape().dims().last().copied().unwrap_or(0);
        let n = dpre.shape().dims().last().copied().unwrap_or(0);
        let mut all = vec![x, dpre];
        all.extend(out.iter());
        same_dtype(op, &all)?;
        if k == 0 || n == 0 {
            // Empty weight gradients (and the bias gradient's plain row sums).
            return Composed::weight_grad(self, precision, x, dpre, out);
        }
        let rows = x.numel() / k;
        let fits = match &*out {
            [dw] => dw.numel() == k * n,
            [dw, db] => dw.numel() == k * n && db.numel() == n,
            _ => false,
        };
        if !fits || dpre.numel() != rows * n {
            return Err(derr(
                op,
                format!(
                    "x {} and dpre {} do not give outputs {:?}",
                    x.shape(),
                    dpre.shape(),
                    out.iter()
                        .map(|o| o.shape().to_string())
                        .collect::<Vec<_>>()
                ),
            ));
        }
        if rows == 0 {
            // Sums over no rows.
            for o in out.iter() {
                fill(self.runtime(), op, o.dtype(), o.ptr(), o.numel(), 0.0, 0)?;
            }
            return Ok(());
        }
        if let Some(t) = self.lt_types(x.dtype(), precision) {
            let epilogue = match &*out {
                [_, db] => Epilogue::BiasGradCols {
                    bias_grad: db.ptr(),
                },
                _ => Epilogue::None,
            };
            // dw [k, n] = x^T dpre: a = x stored [rows, k] transposed, b = dpre [rows, n].
            let g = LtMatmul {
                epilogue,
                ..LtMatmul::new((k, n, rows), (true, false), t)
            };
            if self.lt_ran(&g, x.ptr(), dpre.ptr(), out[0].ptr())? {
                return Ok(());
            }
        }
        Composed::weight_grad(self, precision, x, dpre, out)
    }
}
