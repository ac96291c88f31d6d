//! AdamW's CPU kernels on host arrays: one pass ([`AdamPart`]) in f32 or f64 with ndarray's
//! element-wise zips (in parallel when large; 16-bit data through f32, rounded once), and the
//! multi-tensor op as each tensor's three passes (a clip ratio operand folded into the coefficients first; a NaN one of a `skip_nan`
//! op leaves every tensor as it was).

use ndarray::{ArrayD, Zip};
use oxiflow_tensor::backend::kernel_err;
use oxiflow_tensor::{
    CpuArray, CpuBackend, ExternOp, FloatElement, KernelIo, Result, TensorElement,
};

use super::multi::{AdamPasses, AdamWMulti};
use super::part::AdamPart;
use crate::host_slices::through_wide;

/// Elements from which a pass runs in parallel.
const PARALLEL_FROM: usize = 1 << 15;

fn pass_typed<F: FloatElement>(
    part: AdamPart,
    x: &[&ArrayD<F>],
    out: &mut ArrayD<F>,
) -> Option<()> {
    if x.len() != part.operands() || x.iter().any(|a| a.shape() != out.shape()) {
        return None;
    }
    let [a, b, c, d] = part.coefficients().map(F::from_f64);
    let big = out.len() >= PARALLEL_FROM;
    match part {
        AdamPart::Moment1 { .. } | AdamPart::Moment2 { .. } => {
            let sq = matches!(part, AdamPart::Moment2 { .. });
            let f = move |o: &mut F, &m: &F, &g: &F| *o = m * a + if sq { g * g } else { g } * b;
            let z = Zip::from(out).and(x[0]).and(x[1]);
            if big {
                z.par_for_each(f)
            } else {
                z.for_each(f)
            }
        }
        AdamPart::Update { .. } => {
            let f = move |o: &mut F, &p: &F, &m: &F, &v: &F| {
                *o = p * a - (m * b) / ((v * c).sqrt() + d)
            };
            let z = Zip::from(out).and(x[0]).and(x[1]).and(x[2]);
            if big {
                z.par_for_each(f)
            } else {
                z.for_each(f)
            }
        }
    }
    Some(())
}

impl AdamPasses for CpuBackend {
    fn pass(&self, part: AdamPart, x: &[&CpuArray], out: &mut CpuArray) -> Result<()> {
        fn all<'a, T: TensorElement>(x: &[&'a CpuArray]) -> Option<Vec<&'a ArrayD<T>>> {
            x.iter().map(|a| T::view(a)).collect()
        }
        let done = match out {
            CpuArray::F32(o) => all::<f32>(x).and_then(|v| pass_typed(part, &v, o)),
            CpuArray::F64(o) => all::<f64>(x).and_then(|v| pass_typed(part, &v, o)),
            _ => None,
        };
        done.ok_or_else(|| {
            kernel_err(
                part.name(),
                format!(
                    "needs float operands of one dtype and shape, got {:?}",
                    x.iter()
                        .map(|a| (a.dtype(), a.shape().to_vec()))
                        .collect::<Vec<_>>()
                ),
            )
        })
    }
}

pub(super) fn pass(part: &AdamPart, b: &CpuBackend, io: KernelIo<'_, CpuBackend>) -> Result<()> {
    through_wide(io.inputs, io.outputs, |x, out| {
        let [out] = out else {
            return Err(kernel_err(part.name(), "expects 1 output".into()));
        };
        b.pass(*part, x, out)
    })
}

pub(super) fn multi(op: &AdamWMulti, b: &CpuBackend, io: KernelIo<'_, CpuBackend>) -> Result<()> {
    op.check_io(io.inputs.len(), io.outputs.len())?;
    through_wide(io.inputs, io.outputs, |x, out| {
        let n = op.decay.len();
        if !op.clipped {
            return op.composed(b, 0..n, x, out, false);
        }
        let r = x
            .get(4 * n)
            .and_then(|s| s.as_array::<f64>())
            .and_then(|a| a.iter().next().copied())
            .ok_or_else(|| kernel_err("adamw_multi", "no f64 clip ratio".into()))?;
        op.with_scale(AdamWMulti::ratio_scale(r)).composed(
            b,
            0..n,
            &x[..4 * n],
            out,
            op.keeps_all(r),
        )
    })
}
