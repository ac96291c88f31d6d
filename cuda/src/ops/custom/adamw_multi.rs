//! Multi-tensor AdamW CUDA kernel: one launch of the raw layer's `adamw_multi` for every tensor
//! whose parameter, gradient and moments are f32 (each written to its output buffers, and a
//! bf16 compute copy of the new value in the same launch; a device clip ratio read by the
//! kernel); any other tensor runs its three fused AdamW passes (a device clip ratio read on
//! the host first), and any other copy is a cast after the launch. A NaN ratio of a
//! `skip_nan` op leaves every tensor as it was.

use oxiflow_dtype::DType;

use crate::fused::{adamw_multi, AdamCoef, AdamTensor};
use crate::ops::CudaKernels;
use crate::storage::CudaStorage;
use oxiflow_tensor::backend::kernel_err;
use oxiflow_tensor::custom::{AdamWMulti, AdamWMultiKernels};
use oxiflow_tensor::DeviceStorage;
use oxiflow_tensor::Result;

impl AdamWMultiKernels for CudaKernels {
    fn adamw_multi(
        &self,
        op: &AdamWMulti,
        x: &[&CudaStorage],
        out: &mut [CudaStorage],
    ) -> Result<()> {
        let n = op.decay.len();
        let copies = op.copies.iter().filter(|c| c.is_some()).count();
        if x.len() != 4 * n + usize::from(op.clipped) || out.len() != 3 * n + copies {
            return Err(kernel_err(
                "adamw_multi",
                format!(
                    "{n} tensors with {} operands and {} outputs",
                    x.len(),
                    out.len()
                ),
            ));
        }
        // A tensor outside the one launch takes the composed passes, which fold a device
        // clip ratio read once on the host.
        let mut host_op = None;
        let mut keep = false;
        let mut composed = |i: usize, out: &mut [CudaStorage]| -> Result<()> {
            if host_op.is_none() {
                host_op = Some(match x.get(4 * n).filter(|_| op.clipped) {
                    Some(r) => {
                        let r = ratio_value(r)?;
                        keep = op.keeps_all(r);
                        op.with_scale(AdamWMulti::ratio_scale(r))
                    }
                    None => op.clone(),
                });
            }
            match &host_op {
                Some(h) => h.composed(self, i..i + 1, &x[..4 * n], out, keep),
                None => Ok(()),
            }
        };
        let mut list = Vec::with_capacity(n);
        // Tensors whose copy is cast after the launch.
        let mut cast_after = Vec::new();
        for i in 0..n {
            let (ins, outs) = (&x[4 * i..4 * i + 4], &out[3 * i..3 * i + 3]);
            let count = ins[0].numel();
            let all = || ins.iter().copied().chain(outs);
            let f32s = all().all(|p| p.dtype == DType::F32);
            let fits = all().all(|p| p.numel() == count);
            if !f32s || !fits {
                composed(i, out)?;
                continue;
            }
            let copy = op.copy_index(i).and_then(|k| out.get(k));
            let bf16_copy = match copy {
                Some(c) if c.dtype == DType::BF16 && c.numel() == count => c.ptr(),
                Some(_) => {
                    cast_after.push(i);
                    0
                }
                None => 0,
            };
            if count == 0 {
                continue;
            }
            list.push(AdamTensor {
                param: ins[0].ptr(),
                grad: ins[1].ptr(),
                m: ins[2].ptr(),
                v: ins[3].ptr(),
                param_out: outs[0].ptr(),
                m_out: outs[1].ptr(),
                v_out: outs[2].ptr(),
                param_bf16: bf16_copy,
                n: count as i64,
                decay: op.decay[i].get() as f32,
                grad_bf16: 0,
            });
        }
        let mut coef = AdamCoef::new(
            [
                op.beta1, op.g1, op.beta2, op.g2, op.step, op.inv_bc2, op.eps,
            ]
            .map(|c| c.get()),
        );
        if op.clipped {
            let ratio = x
                .get(4 * n)
                .filter(|r| r.dtype == DType::F64 && r.numel() == 1)
                .ok_or_else(|| kernel_err("adamw_multi", "no f64 clip ratio".into()))?;
            coef = coef.clipped_by(ratio.ptr());
            if op.skip_nan {
                coef = coef.skipping_nan();
            }
        }
        adamw_multi(&self.rt, &list, &coef)?;
        for i in cast_after {
            op.cast_copy(self, i, out)?;
        }
        Ok(())
    }
}

/// The value of a device 0-d f64 (one host read).
fn ratio_value(r: &CudaStorage) -> Result<f64> {
    r.to_host()?
        .as_array::<f64>()
        .and_then(|a| a.iter().next().copied())
        .ok_or_else(|| kernel_err("adamw_multi", format!("clip ratio {} {}", r.dtype, r.shape)))
}
