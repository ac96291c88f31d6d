//! Neural-network CPU kernels: embedding lookup, layer norm, cross-entropy, and their backward
//! kernels (embedding scatter-add, layer-norm input gradient, cross-entropy logits gradient).

use ndarray::{Array2, ArrayD, ArrayView2, Axis, IxDyn, Zip};

use crate::element::FloatElement;
use crate::kernels::elementwise::PAR_THRESHOLD;
use crate::storage::CpuArray;
use crate::{Result, TensorError};

fn kerr(op: &'static str, detail: String) -> TensorError {
    TensorError::Kernel { op, detail }
}

fn rows<F: FloatElement>(a: &ArrayD<F>) -> Option<ArrayView2<'_, F>> {
    let (&h, lead) = a.shape().split_last()?;
    a.view()
        .into_shape_with_order((lead.iter().product::<usize>(), h))
        .ok()
}

fn check_ids(op: &'static str, ids: &ArrayD<i64>, num: usize) -> Result<()> {
    match ids.iter().find(|&&i| i < 0 || i as usize >= num) {
        Some(bad) => Err(kerr(op, format!("index {bad} out of range 0..{num}"))),
        None => Ok(()),
    }
}

fn embedding_t<F: FloatElement>(w: &ArrayD<F>, ids: &ArrayD<i64>) -> Result<ArrayD<F>> {
    let w2 = rows(w).ok_or_else(|| kerr("embedding", "weight must be 2-d".into()))?;
    check_ids("embedding", ids, w2.nrows())?;
    let h = w2.ncols();
    let mut out = Array2::<F>::zeros((ids.len(), h));
    for (mut row, &i) in out.outer_iter_mut().zip(ids.iter()) {
        row.assign(&w2.row(i as usize));
    }
    let mut shape = ids.shape().to_vec();
    shape.push(h);
    out.into_shape_with_order(IxDyn(&shape))
        .map_err(|e| kerr("embedding", e.to_string()))
}

/// weight [V, H] gathered at ids [..] -> [.., H].
pub fn embedding(w: &CpuArray, ids: &CpuArray) -> Result<CpuArray> {
    match (w, ids) {
        (CpuArray::F32(w), CpuArray::I64(i)) => Ok(CpuArray::F32(embedding_t(w, i)?)),
        (CpuArray::F64(w), CpuArray::I64(i)) => Ok(CpuArray::F64(embedding_t(w, i)?)),
        _ => Err(kerr("embedding", "needs a float weight and i64 ids".into())),
    }
}

fn embedding_backward_t<F: FloatElement>(
    dy: &ArrayD<F>,
    ids: &ArrayD<i64>,
    num: usize,
) -> Result<ArrayD<F>> {
    let g =
        rows(dy).ok_or_else(|| kerr("embedding_backward", "dy must have a hidden dim".into()))?;
    check_ids("embedding_backward", ids, num)?;
    let mut out = Array2::<F>::zeros((num, g.ncols()));
    for (row, &i) in g.outer_iter().zip(ids.iter()) {
        let mut o = out.row_mut(i as usize);
        o += &row;
    }
    Ok(out.into_dyn())
}

/// Scatter-add of dy [.., H] rows into dweight [num, H] at ids [..].
pub fn embedding_backward(dy: &CpuArray, ids: &CpuArray, num: usize) -> Result<CpuArray> {
    match (dy, ids) {
        (CpuArray::F32(g), CpuArray::I64(i)) => Ok(CpuArray::F32(embedding_backward_t(g, i, num)?)),
        (CpuArray::F64(g), CpuArray::I64(i)) => Ok(CpuArray::F64(embedding_backward_t(g, i, num)?)),
        _ => Err(kerr(
            "embedding_backward",
            "needs float dy and i64 ids".into(),
        )),
    }
}

/// Mean and 1/std of one row.
fn moments<F: FloatElement>(x: ndarray::ArrayView1<F>, eps: F) -> (F, F) {
    let n = F::from_f64(x.len().max(1) as f64);
    let mean = x.sum() / n;
    let mut var = F::from_f64(0.0);
    x.iter().for_each(|&v| var += (v - mean) * (v - mean));
    (mean, (var / n + eps).sqrt().recip())
}

fn layer_norm_t<F: FloatElement>(
    x: &ArrayD<F>,
    w: Option<&ArrayD<F>>,
    b: Option<&ArrayD<F>>,
    eps: f64,
) -> Result<ArrayD<F>> {
    let eps = F::from_f64(eps);
    let mut out = x.to_owned();
    let h = *x
        .shape()
        .last()
        .ok_or_else(|| kerr("layer_norm", "needs a dim".into()))?;
    let n: usize = x.shape()[..x.ndim() - 1].iter().product();
    let mut o2 = out
        .view_mut()
        .into_shape_with_order((n, h))
        .map_err(|e| kerr("layer_norm", e.to_string()))?;
    let w = w.map(|a| a.view());
    let b = b.map(|a| a.view());
    let f = |mut row: ndarray::ArrayViewMut1<F>| {
        let (mean, rstd) = moments(row.view(), eps);
        for (j, v) in row.iter_mut().enumerate() {
            let mut y = (*v - mean) * rstd;
            if let Some(w) = &w {
                y *= w[[j]];
            }
            if let Some(b) = &b {
                y += b[[j]];
            }
            *v = y;
        }
    };
    let z = Zip::from(o2.axis_iter_mut(Axis(0)));
    if n * h >= PAR_THRESHOLD {
        z.par_for_each(f);
    } else {
        z.for_each(f);
    }
    Ok(out)
}

/// Layer norm over the last dim, with optional weight and bias [H].
pub fn layer_norm(
    x: &CpuArray,
    w: Option<&CpuArray>,
    b: Option<&CpuArray>,
    eps: f64,
) -> Result<CpuArray> {
    match x {
        CpuArray::F32(x) => Ok(CpuArray::F32(layer_norm_t(
            x,
            w.and_then(|a| a.as_array()),
            b.and_then(|a| a.as_array()),
            eps,
        )?)),
        CpuArray::F64(x) => Ok(CpuArray::F64(layer_norm_t(
            x,
            w.and_then(|a| a.as_array()),
            b.and_then(|a| a.as_array()),
            eps,
        )?)),
        CpuArray::I64(_) => Err(kerr("layer_norm", "needs a float input".into())),
    }
}

fn layer_norm_backward_t<F: FloatElement>(
    dy: &ArrayD<F>,
    x: &ArrayD<F>,
    w: Option<&ArrayD<F>>,
    eps: f64,
) -> Result<ArrayD<F>> {
    let eps = F::from_f64(eps);
    let xr = rows(x).ok_or_else(|| kerr("layer_norm_backward", "needs a dim".into()))?;
    let h = xr.ncols();
    let hf = F::from_f64(h.max(1) as f64);
    let mut out = dy.to_owned();
    let mut o2 = out
        .view_mut()
        .into_shape_with_order((xr.nrows(), h))
        .map_err(|e| kerr("layer_norm_backward", e.to_string()))?;
    let w = w.map(|a| a.view());
    let f = |mut g: ndarray::ArrayViewMut1<F>, x: ndarray::ArrayView1<F>| {
        let (mean, rstd) = moments(x, eps);
        if let Some(w) = &w {
            for (j, v) in g.iter_mut().enumerate() {
                *v *= w[[j]];
            }
        }
        let (mut sg, mut sgx) = (F::from_f64(0.0), F::from_f64(0.0));
        for (&gv, &xv) in g.iter().zip(x.iter()) {
            sg += gv;
            sgx += gv * (xv - mean) * rstd;
        }
        let (mg, mgx) = (sg / hf, sgx / hf);
        for (gv, &xv) in g.iter_mut().zip(x.iter()) {
            let xh = (xv - mean) * rstd;
            *gv = rstd * (*gv - mg - xh * mgx);
        }
    };
    let z = Zip::from(o2.axis_iter_mut(Axis(0))).and(xr.axis_iter(Axis(0)));
    if xr.len() >= PAR_THRESHOLD {
        z.par_for_each(f);
    } else {
        z.for_each(f);
    }
    Ok(out)
}

/// dx of layer norm over the last dim (weight optional).
pub fn layer_norm_backward(
    dy: &CpuArray,
    x: &CpuArray,
    w: Option<&CpuArray>,
    eps: f64,
) -> Result<CpuArray> {
    match (dy, x) {
        (CpuArray::F32(g), CpuArray::F32(x)) => Ok(CpuArray::F32(layer_norm_backward_t(
            g,
            x,
            w.and_then(|a| a.as_array()),
            eps,
        )?)),
        (CpuArray::F64(g), CpuArray::F64(x)) => Ok(CpuArray::F64(layer_norm_backward_t(
            g,
            x,
            w.and_then(|a| a.as_array()),
            eps,
        )?)),
        _ => Err(kerr(
            "layer_norm_backward",
            "needs float dy and x of one dtype".into(),
        )),
    }
}

/// log-sum-exp of one row.
fn lse<F: FloatElement>(r: ndarray::ArrayView1<F>) -> F {
    let m = r.fold(F::lowest(), |a, &x| if x > a { x } else { a });
    let m = if m == F::lowest() {
        F::from_f64(0.0)
    } else {
        m
    };
    let mut s = F::from_f64(0.0);
    r.iter().for_each(|&x| s += (x - m).exp());
    s.ln() + m
}

fn check_labels(op: &'static str, labels: &ArrayD<i64>, c: usize) -> Result<()> {
    check_ids(op, labels, c)
}

fn cross_entropy_t<F: FloatElement>(logits: &ArrayD<F>, labels: &ArrayD<i64>) -> Result<ArrayD<F>> {
    let l = rows(logits).ok_or_else(|| kerr("cross_entropy", "logits must be 2-d".into()))?;
    check_labels("cross_entropy", labels, l.ncols())?;
    let out: Vec<F> = l
        .outer_iter()
        .zip(labels.iter())
        .map(|(r, &y)| lse(r) - r[y as usize])
        .collect();
    ArrayD::from_shape_vec(IxDyn(&[out.len()]), out)
        .map_err(|e| kerr("cross_entropy", e.to_string()))
}

/// Per-sample loss of logits [N, C] against labels [N].
pub fn cross_entropy(logits: &CpuArray, labels: &CpuArray) -> Result<CpuArray> {
    match (logits, labels) {
        (CpuArray::F32(l), CpuArray::I64(y)) => Ok(CpuArray::F32(cross_entropy_t(l, y)?)),
        (CpuArray::F64(l), CpuArray::I64(y)) => Ok(CpuArray::F64(cross_entropy_t(l, y)?)),
        _ => Err(kerr(
            "cross_entropy",
            "needs float logits and i64 labels".into(),
        )),
    }
}

fn cross_entropy_backward_t<F: FloatElement>(
    dy: &ArrayD<F>,
    logits: &ArrayD<F>,
    labels: &ArrayD<i64>,
) -> Result<ArrayD<F>> {
    let l =
        rows(logits).ok_or_else(|| kerr("cross_entropy_backward", "logits must be 2-d".into()))?;
    check_labels("cross_entropy_backward", labels, l.ncols())?;
    let mut out = l.to_owned();
    for ((mut r, &y), &g) in out.outer_iter_mut().zip(labels.iter()).zip(dy.iter()) {
        let s = lse(r.view());
        r.mapv_inplace(|x| (x - s).exp() * g);
        r[y as usize] = r[y as usize] - g;
    }
    Ok(out.into_dyn())
}

/// dlogits [N, C] = dy[n] * (softmax(logits[n]) - onehot(labels[n])).
pub fn cross_entropy_backward(
    dy: &CpuArray,
    logits: &CpuArray,
    labels: &CpuArray,
) -> Result<CpuArray> {
    match (dy, logits, labels) {
        (CpuArray::F32(g), CpuArray::F32(l), CpuArray::I64(y)) => {
            Ok(CpuArray::F32(cross_entropy_backward_t(g, l, y)?))
        }
        (CpuArray::F64(g), CpuArray::F64(l), CpuArray::I64(y)) => {
            Ok(CpuArray::F64(cross_entropy_backward_t(g, l, y)?))
        }
        _ => Err(kerr(
            "cross_entropy_backward",
            "needs float dy/logits and i64 labels".into(),
        )),
    }
}
