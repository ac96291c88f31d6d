//! RMS-norm CPU kernel: one pass per row (rayon over rows when large).

use ndarray::{ArrayD, Axis, Zip};

use super::elementwise::PAR_THRESHOLD;
use super::{checked, CpuBackend};
use crate::element::FloatElement;
use crate::op::{kernel_err, OutSpec, RmsNormKernels};
use crate::storage::CpuArray;
use crate::Result;

fn rms_norm_t<F: FloatElement>(x: &ArrayD<F>, w: &ArrayD<F>, eps: f64) -> Result<ArrayD<F>> {
    let op = "rms_norm";
    let h = *x
        .shape()
        .last()
        .ok_or_else(|| kernel_err(op, "needs a dim".into()))?;
    if w.shape() != [h] {
        return Err(kernel_err(
            op,
            format!("weight {:?} for rows of {h}", w.shape()),
        ));
    }
    let (eps, n) = (F::from_f64(eps), F::from_f64(h.max(1) as f64));
    let rows: usize = x.shape()[..x.ndim() - 1].iter().product();
    let mut out = x.as_standard_layout().into_owned();
    let mut o2 = out
        .view_mut()
        .into_shape_with_order((rows, h))
        .map_err(|e| kernel_err(op, e.to_string()))?;
    let f = |mut row: ndarray::ArrayViewMut1<F>| {
        let mut ss = F::from_f64(0.0);
        row.iter().for_each(|&v| ss += v * v);
        let r = (ss / n + eps).sqrt().recip();
        for (v, &wj) in row.iter_mut().zip(w.iter()) {
            *v = *v * r * wj;
        }
    };
    let z = Zip::from(o2.axis_iter_mut(Axis(0)));
    if rows * h >= PAR_THRESHOLD {
        z.par_for_each(f);
    } else {
        z.for_each(f);
    }
    Ok(out)
}

impl RmsNormKernels for CpuBackend {
    fn rms_norm(&self, x: &CpuArray, w: &CpuArray, eps: f64, out: &OutSpec) -> Result<CpuArray> {
        let y = match (x, w) {
            (CpuArray::F32(x), CpuArray::F32(w)) => CpuArray::F32(rms_norm_t(x, w, eps)?),
            (CpuArray::F64(x), CpuArray::F64(w)) => CpuArray::F64(rms_norm_t(x, w, eps)?),
            _ => {
                return Err(kernel_err(
                    "rms_norm",
                    "needs float x and weight of one dtype".into(),
                ))
            }
        };
        checked("rms_norm", y, out)
    }
}
