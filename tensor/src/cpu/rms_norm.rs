//! RMS-norm CPU kernel, written into the executor's output buffer: one pass per row (rayon over
//! rows when large).

use ndarray::{ArrayD, ArrayView1, ArrayViewMut1, Axis};

use super::{out_as, rows, view_mut_as, CpuBackend};
use crate::element::FloatElement;
use crate::op::{kernel_err, RmsNormKernels};
use crate::storage::CpuArray;
use crate::Result;

fn rms_norm_t<F: FloatElement>(
    x: &ArrayD<F>,
    w: &ArrayD<F>,
    eps: f64,
    out: &mut ArrayD<F>,
) -> Result<()> {
    let op = "rms_norm";
    let xr = rows(x).ok_or_else(|| kernel_err(op, "needs a dim".into()))?;
    let (n, h) = (xr.nrows(), xr.ncols());
    if w.shape() != [h] || out.shape() != x.shape() {
        return Err(kernel_err(
            op,
            format!(
                "weight {:?} and output {:?} for rows of {h}",
                w.shape(),
                out.shape()
            ),
        ));
    }
    let (eps, hf) = (F::from_f64(eps), F::from_f64(h.max(1) as f64));
    let mut o2 = view_mut_as(op, out, (n, h))?;
    let f = |y: ArrayViewMut1<F>, x: ArrayView1<F>| {
        let mut ss = F::from_f64(0.0);
        x.iter().for_each(|&v| ss += v * v);
        let r = (ss / hf + eps).sqrt().recip();
        for ((y, &v), &wj) in y.into_iter().zip(x.iter()).zip(w.iter()) {
            *y = v * r * wj;
        }
    };
    for_each_row!(n * h, f; o2.axis_iter_mut(Axis(0)), xr.axis_iter(Axis(0)));
    Ok(())
}

impl RmsNormKernels for CpuBackend {
    fn rms_norm(&self, x: &CpuArray, w: &CpuArray, eps: f64, out: &mut CpuArray) -> Result<()> {
        let op = "rms_norm";
        with_floats!(op, "needs float x and weight of one dtype"; (x, w) as (x, w) => {
            rms_norm_t(x, w, eps, out_as(op, out)?)
        })
    }
}
