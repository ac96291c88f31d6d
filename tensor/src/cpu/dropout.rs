//! Dropout CPU kernel, written into the executor's output buffer: each element's global
//! row-major index from the piece's place in the global tensor, kept (scaled by `1 / (1 - p)`)
//! when `rng::uniform(seed, index) >= p`, else 0; rayon when large.

use ndarray::ArrayD;
use rayon::prelude::*;

use super::PAR_THRESHOLD;
use super::{fits, float_input, out_as, CpuBackend};
use crate::element::FloatElement;
use crate::op::{kernel_err, DropoutKernels, DropoutOp};
use crate::rng;
use crate::storage::CpuArray;
use crate::Result;

fn dropout_t<F: FloatElement>(x: &ArrayD<F>, op: &DropoutOp, out: &mut ArrayD<F>) -> Result<()> {
    let local = x.shape().to_vec();
    fits("dropout", &local, out.shape())?;
    op.check_piece(&local)?;
    let strides = op.global.strides();
    let (p, seed) = (op.p.get(), op.seed);
    let (scale, zero) = (F::from_f64(op.keep_scale()), F::from_f64(0.0));
    let x = x.as_standard_layout();
    let xs = x
        .as_slice()
        .ok_or_else(|| kernel_err("dropout", "input not contiguous".into()))?;
    let os = out
        .as_slice_mut()
        .ok_or_else(|| kernel_err("dropout", "output not contiguous".into()))?;
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
    if os.len() >= PAR_THRESHOLD {
        os.par_iter_mut()
            .enumerate()
            .for_each(|(l, o)| *o = value(l));
    } else {
        os.iter_mut().enumerate().for_each(|(l, o)| *o = value(l));
    }
    Ok(())
}

impl DropoutKernels for CpuBackend {
    fn dropout(&self, x: &CpuArray, op: &DropoutOp, out: &mut CpuArray) -> Result<()> {
        match x {
            CpuArray::F32(x) => dropout_t(x, op, out_as("dropout", out)?),
            CpuArray::F64(x) => dropout_t(x, op, out_as("dropout", out)?),
            x => Err(float_input("dropout", x)),
        }
    }
}
