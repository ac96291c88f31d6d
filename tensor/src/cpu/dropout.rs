//! Dropout CPU kernel: each element's global row-major index from the piece's place in the
//! global tensor, kept (scaled by `1 / (1 - p)`) when `rng::uniform(seed, index) >= p`, else 0;
//! rayon when large.

use ndarray::{ArrayD, IxDyn};

use super::elementwise::PAR_THRESHOLD;
use super::float_input;
use super::{checked, CpuBackend};
use crate::element::FloatElement;
use crate::op::{kernel_err, DropoutKernels, DropoutOp, OutSpec};
use crate::rng;
use crate::storage::CpuArray;
use crate::Result;
use rayon::prelude::*;

fn dropout_t<F: FloatElement>(x: &ArrayD<F>, op: &DropoutOp) -> Result<ArrayD<F>> {
    let local = x.shape().to_vec();
    op.check_piece(&local)?;
    let strides = op.global.strides();
    let (p, seed) = (op.p.get(), op.seed);
    let (scale, zero) = (F::from_f64(op.keep_scale()), F::from_f64(0.0));
    let x = x.as_standard_layout();
    let xs = x
        .as_slice()
        .ok_or_else(|| kernel_err("dropout", "input not contiguous".into()))?;
    let value = |l: usize| -> F {
        let (mut rem, mut g) = (l, 0usize);
        for d in (0..local.len()).rev() {
            let i = rem % local[d];
            rem /= local[d];
            g += (op.starts[d] + i) * strides[d];
        }
        if rng::uniform(seed, g as u64) >= p {
            xs[l] * scale
        } else {
            zero
        }
    };
    let n = xs.len();
    let data: Vec<F> = if n >= PAR_THRESHOLD {
        (0..n).into_par_iter().map(value).collect()
    } else {
        (0..n).map(value).collect()
    };
    ArrayD::from_shape_vec(IxDyn(&local), data).map_err(|e| kernel_err("dropout", e.to_string()))
}

impl DropoutKernels for CpuBackend {
    fn dropout(&self, x: &CpuArray, op: &DropoutOp, out: &OutSpec) -> Result<CpuArray> {
        let y = match x {
            CpuArray::F32(x) => CpuArray::F32(dropout_t(x, op)?),
            CpuArray::F64(x) => CpuArray::F64(dropout_t(x, op)?),
            x => return Err(float_input("dropout", x)),
        };
        checked("dropout", y, out)
    }
}
