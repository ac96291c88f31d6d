//! Rotary position embedding CPU kernel: pairs (i, i + D/2) of the last dim rotated by
//! `pos * base^(-2i/D)` (f64 angles), `pos` the global sequence position.

use ndarray::ArrayD;

use super::float_input;
use super::{checked, CpuBackend};
use crate::element::FloatElement;
use crate::op::{kernel_err, OpFamily, OutSpec, RotaryKernels, RotaryOp};
use crate::storage::CpuArray;
use crate::Result;

fn rotary_t<F: FloatElement>(x: &ArrayD<F>, op: &RotaryOp) -> Result<ArrayD<F>> {
    let shape = x.shape();
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
    let mut out = xs.to_vec();
    for (l, o) in out.iter_mut().enumerate() {
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
    ArrayD::from_shape_vec(shape.to_vec(), out).map_err(|e| kernel_err(op.name(), e.to_string()))
}

impl RotaryKernels for CpuBackend {
    fn rotary(&self, x: &CpuArray, op: &RotaryOp, out: &OutSpec) -> Result<CpuArray> {
        let y = match x {
            CpuArray::F32(x) => CpuArray::F32(rotary_t(x, op)?),
            CpuArray::F64(x) => CpuArray::F64(rotary_t(x, op)?),
            x => return Err(float_input(op.name(), x)),
        };
        checked(op.name(), y, out)
    }
}
