//! AdamW's CUDA kernels: a pass ([`AdamPart`]) is one launch of the library's `adam` template
//! in the operands' dtype; the multi-tensor op is one launch of the library's `adamw_multi`
//! for every tensor whose parameter, gradient and moments are f32 (each written to its output
//! buffers, a bf16 compute copy of the new value in the same launch, a device clip ratio read
//! by the kernel); any other tensor runs its three passes (a device clip ratio read on the host
//! first), and any other copy is a cast after the launch. A NaN ratio of a `skip_nan` op leaves
//! every tensor as it was.

use oxiflow_cuda::kernel_layer::{adamw_multi, grid, AdamCoef, AdamTensor, Template};
use oxiflow_cuda::{device_error, launch, CudaKernels, CudaStorage};
use oxiflow_dtype::DType;
use oxiflow_tensor::backend::kernel_err;
use oxiflow_tensor::{DeviceStorage, ExternOp, KernelIo, Result};

use super::multi::{AdamPasses, AdamWMulti};
use super::part::AdamPart;

impl AdamPasses for CudaKernels {
    fn pass(&self, part: AdamPart, x: &[&CudaStorage], out: &mut CudaStorage) -> Result<()> {
        let (rt, name) = (self.runtime(), part.name());
        let dt = out.dtype();
        if !dt.is_float() {
            return Err(device_error(name, format!("needs a float input, got {dt}")));
        }
        let n = out.numel();
        let want = part.operands();
        if x.len() != want || x.iter().any(|p| p.dtype() != dt || p.numel() != n) {
            return Err(device_error(
                name,
                format!(
                    "needs {want} {dt} pieces of {} elements, got {:?}",
                    n,
                    x.iter().map(|p| (p.dtype(), p.numel())).collect::<Vec<_>>()
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

pub(super) fn pass(part: &AdamPart, b: &CudaKernels, io: KernelIo<'_, CudaKernels>) -> Result<()> {
    let [out] = io.outputs else {
        return Err(device_error(part.name(), "expects 1 output"));
    };
    b.pass(*part, io.inputs, out)
}

pub(super) fn multi(op: &AdamWMulti, b: &CudaKernels, io: KernelIo<'_, CudaKernels>) -> Result<()> {
    let (x, out) = (io.inputs, io.outputs);
    op.check_io(x.len(), out.len())?;
    let n = op.decay.len();
    // A tensor outside the one launch takes the composed passes, which fold a device clip
    // ratio read once on the host.
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
            Some(h) => h.composed(b, i..i + 1, &x[..4 * n], out, keep),
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
        let f32s = all().all(|p| p.dtype() == DType::F32);
        let fits = all().all(|p| p.numel() == count);
        if !f32s || !fits {
            composed(i, out)?;
            continue;
        }
        let copy = op.copy_index(i).and_then(|k| out.get(k));
        let bf16_copy = match copy {
            Some(c) if c.dtype() == DType::BF16 && c.numel() == count => c.ptr(),
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
            .filter(|r| r.dtype() == DType::F64 && r.numel() == 1)
            .ok_or_else(|| kernel_err("adamw_multi", "no f64 clip ratio".into()))?;
        coef = coef.clipped_by(ratio.ptr());
        if op.skip_nan {
            coef = coef.skipping_nan();
        }
    }
    adamw_multi(b.runtime(), &list, &coef)?;
    for i in cast_after {
        op.cast_copy(b, i, out)?;
    }
    Ok(())
}

/// The value of a device 0-d f64 (one host read).
fn ratio_value(r: &CudaStorage) -> Result<f64> {
    r.to_host()?
        .as_array::<f64>()
        .and_then(|a| a.iter().next().copied())
        .ok_or_else(|| {
            kernel_err(
                "adamw_multi",
                format!("clip ratio {} {}", r.dtype(), r.shape()),
            )
        })
}
