//! Rotary position embedding CPU kernel, written into the executor's output buffer: pairs
//! (i, i + D/2) of the last dim rotated by `pos * base^(-2i/D)` (f64 angles), `pos` the global
//! sequence position; 16-bit inputs rotate in f32.

use ndarray::ArrayD;
use oxiflow_dtype::{bf16, f16};

use super::{fits, float_input, out_as, CpuBackend};
use crate::element::FloatElement;
use crate::op::{kernel_err, OpFamily, RotaryKernels, RotaryOp};
use crate::storage::CpuArray;
use crate::Result;

fn rotary_t<F: FloatElement>(x: &ArrayD<F>, op: &RotaryOp, out: &mut ArrayD<F>) -> Result<()> {
    let shape = x.shape();
    fits(op.name(), shape, out.shape())?;
    let d = *shape.last().unwrap_or(&0);
    let (Some(&t), true) = (shape.get(op.seq_dim), d.is_multiple_of(2)) else {
        return Err(kernel_err(op.name(), format!("bad input {shape:?}")));
    };
    let inner: usize = shape[op.seq_dim + 1..].iter().product();
    let half = d / 2;
    let sign = if op.inverse { -1.0 } else { 1.0 };
    let x = x.as_standard_layout();
    let xs = x
        .as_slice()
        .ok_or_else(|| kernel_err(op.name(), "non-contiguous input".into()))?;
    let os = out
        .as_slice_mut()
        .ok_or_else(|| kernel_err(op.name(), "non-contiguous output".into()))?;
    for (l, o) in os.iter_mut().enumerate() {
        let j = l % d;
        let pos = (op.pos0 + (l / inner) % t) as f64;
        let i = j % half;
        let angle = pos * op.base.get().powf(-2.0 * i as f64 / d as f64);
        let (sin, cos) = (sign * angle.sin(), angle.cos());
        let (sin, cos) = (F::from_f64(sin), F::from_f64(cos));
        *o = if j < half {
            xs[l] * cos - xs[l + half] * sin
        } else {
            xs[l - half] * sin + xs[l] * cos
        };
    }
    Ok(())
}

/// A 16-bit input rotated in f32 and rounded once per element.
fn through_f32<H: Copy + Into<f32>>(
    x: &ArrayD<H>,
    op: &RotaryOp,
    out: &mut ArrayD<H>,
    narrow: fn(f32) -> H,
) -> Result<()> {
    let wide = x.mapv(Into::into);
    let mut y = ArrayD::<f32>::zeros(x.raw_dim());
    rotary_t(&wide, op, &mut y)?;
    fits(op.name(), y.shape(), out.shape())?;
    out.zip_mut_with(&y, |o, &v| *o = narrow(v));
    Ok(())
}

impl RotaryKernels for CpuBackend {
    fn rotary(&self, x: &CpuArray, op: &RotaryOp, out: &mut CpuArray) -> Result<()> {
        match x {
            CpuArray::F32(x) => rotary_t(x, op, out_as(op.name(), out)?),
            CpuArray::F64(x) => rotary_t(x, op, out_as(op.name(), out)?),
            CpuArray::BF16(x) => through_f32(x, op, out_as(op.name(), out)?, bf16::from_f32),
            CpuArray::F16(x) => through_f32(x, op, out_as(op.name(), out)?, f16::from_f32),
            x => Err(float_input(op.name(), x)),
        }
    }
}
