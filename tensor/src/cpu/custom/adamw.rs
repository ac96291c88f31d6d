//! Fused AdamW CPU kernel, written into the executor's output buffer (rayon when large).

use ndarray::{ArrayD, Zip};

use crate::cpu::{CpuBackend, PAR_THRESHOLD};
use crate::element::{FloatElement, TensorElement};
use crate::op::custom::{AdamPart, AdamWKernels};
use crate::op::{kernel_err, OpFamily};
use crate::storage::CpuArray;
use crate::Result;

fn adam_t<F: FloatElement>(part: AdamPart, x: &[&ArrayD<F>], out: &mut ArrayD<F>) -> Option<()> {
    if x.len() != part.operands() || x.iter().any(|a| a.shape() != out.shape()) {
        return None;
    }
    let [a, b, c, d] = part.coefficients().map(F::from_f64);
    let big = out.len() >= PAR_THRESHOLD;
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

impl AdamWKernels for CpuBackend {
    fn adam(&self, part: AdamPart, x: &[&CpuArray], out: &mut CpuArray) -> Result<()> {
        fn all<'a, T: TensorElement>(x: &[&'a CpuArray]) -> Option<Vec<&'a ArrayD<T>>> {
            x.iter().map(|a| T::view(a)).collect()
        }
        let done = match out {
            CpuArray::F32(o) => all::<f32>(x).and_then(|v| adam_t(part, &v, o)),
            CpuArray::F64(o) => all::<f64>(x).and_then(|v| adam_t(part, &v, o)),
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
