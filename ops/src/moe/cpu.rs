//! The mixture-of-experts CPU kernels on host arrays: rows grouped by expert (gathered into
//! one matrix per expert), one product per expert (in parallel over experts), results put back
//! in row order; f32 and f64 computed in their own precision, bf16 in f32 (rounded once per
//! output element).

use half::bf16;
use ndarray::{Array2, ArrayView2, Ix2, LinalgScalar};
use oxiflow_tensor::{CpuArray, CpuBackend, ExternOp, KernelIo, Result, TensorElement};
use rayon::prelude::*;

use super::{ExpertMatmul, ExpertMatmulWgrad, RouterTopk};
use crate::cpu_dispatch::cpu_kernels_by_dtype;
use crate::host_slices::{input_array, kernel_err, output_array, Elem, Wide};

/// Input `i` as a 2-d array of `T`.
fn matrix<'a, T: Elem>(
    op: &'static str,
    x: &'a [&'a CpuArray],
    i: usize,
) -> Result<ArrayView2<'a, T>> {
    input_array::<T>(op, x, i)?
        .view()
        .into_dimensionality::<Ix2>()
        .map_err(|e| kernel_err(op, format!("input {i} is not 2-d: {e}")))
}

/// The rows of each of `experts` experts, in row order, from the ids input `i` (each id
/// checked to name an expert).
fn rows_of(op: &'static str, x: &[&CpuArray], i: usize, experts: usize) -> Result<Vec<Vec<usize>>> {
    let ids = x
        .get(i)
        .and_then(|a| i64::view(a))
        .ok_or_else(|| kernel_err(op, format!("input {i} (the expert ids) is not i64")))?;
    let mut rows = vec![Vec::new(); experts];
    for (m, &e) in ids.iter().enumerate() {
        let slot = usize::try_from(e)
            .ok()
            .and_then(|e| rows.get_mut(e))
            .ok_or_else(|| {
                kernel_err(op, format!("row {m} is routed to expert {e} of {experts}"))
            })?;
        slot.push(m);
    }
    Ok(rows)
}

/// The rows `rows` of `x`, widened.
fn gather<T: Elem>(x: &ArrayView2<'_, T>, rows: &[usize]) -> Array2<T::W>
where
    T::W: LinalgScalar,
{
    Array2::from_shape_fn((rows.len(), x.ncols()), |(r, c)| x[[rows[r], c]].widen())
}

/// `x` widened.
fn widen<T: Elem>(x: &ArrayView2<'_, T>) -> Array2<T::W>
where
    T::W: LinalgScalar,
{
    x.mapv(Elem::widen)
}

/// Output `i` as a 2-d array of `T` of `shape`.
fn output<'a, T: Elem>(
    op: &'static str,
    out: &'a mut [CpuArray],
    i: usize,
    shape: (usize, usize),
) -> Result<ndarray::ArrayViewMut2<'a, T>> {
    let a = output_array::<T>(op, out, i)?;
    let got = a.shape().to_vec();
    a.view_mut()
        .into_dimensionality::<Ix2>()
        .ok()
        .filter(|v| v.dim() == shape)
        .ok_or_else(|| kernel_err(op, format!("output {i} is {got:?}, expected {shape:?}")))
}

fn matmul_typed<T: Elem>(op: &ExpertMatmul, io: KernelIo<'_, CpuBackend>) -> Result<()>
where
    T::W: LinalgScalar,
{
    let name = op.name();
    let x = matrix::<T>(name, io.inputs, 0)?;
    let rows = rows_of(name, io.inputs, 1, op.experts)?;
    let ws = (0..op.experts)
        .map(|e| matrix::<T>(name, io.inputs, 2 + e))
        .collect::<Result<Vec<_>>>()?;
    let (k, n) = ws.first().map(|w| w.dim()).unwrap_or((0, 0));
    let (inner, outer) = if op.transposed { (n, k) } else { (k, n) };
    if x.ncols() != inner || ws.iter().any(|w| w.dim() != (k, n)) {
        return Err(kernel_err(
            name,
            format!("rows {:?} against matrices [{k}, {n}]", x.dim()),
        ));
    }
    let products: Vec<Array2<T::W>> = rows
        .par_iter()
        .zip(ws.par_iter())
        .map(|(rows, w)| {
            if rows.is_empty() {
                return Array2::zeros((0, outer));
            }
            let (xe, w) = (gather(&x, rows), widen(w));
            if op.transposed {
                xe.dot(&w.t())
            } else {
                xe.dot(&w)
            }
        })
        .collect();
    let mut y = output::<T>(name, io.outputs, 0, (x.nrows(), outer))?;
    for (rows, p) in rows.iter().zip(&products) {
        for (r, &m) in rows.iter().enumerate() {
            y.row_mut(m)
                .iter_mut()
                .zip(p.row(r))
                .for_each(|(y, &v)| *y = T::narrow(v));
        }
    }
    Ok(())
}

fn wgrad_typed<T: Elem>(op: &ExpertMatmulWgrad, io: KernelIo<'_, CpuBackend>) -> Result<()>
where
    T::W: LinalgScalar,
{
    let name = op.name();
    let a = matrix::<T>(name, io.inputs, 0)?;
    let rows = rows_of(name, io.inputs, 1, op.experts)?;
    let b = matrix::<T>(name, io.inputs, 2)?;
    if a.nrows() != b.nrows() {
        return Err(kernel_err(
            name,
            format!("a {:?} and b {:?} have different rows", a.dim(), b.dim()),
        ));
    }
    let shape = (a.ncols(), b.ncols());
    let grads: Vec<Array2<T::W>> = rows
        .par_iter()
        .map(|rows| gather(&a, rows).t().dot(&gather(&b, rows)))
        .collect();
    for (e, g) in grads.iter().enumerate() {
        let mut out = output::<T>(name, io.outputs, e, shape)?;
        out.iter_mut()
            .zip(g.iter())
            .for_each(|(o, &v)| *o = T::narrow(v));
    }
    Ok(())
}

/// The counts are written as `T` (exact for counts below 2^24 in f32, 2^53 in f64).
fn topk_typed<T: Elem + Into<f64>>(op: &RouterTopk, io: KernelIo<'_, CpuBackend>) -> Result<()> {
    let name = op.name();
    let p = matrix::<T>(name, io.inputs, 0)?;
    let (m, experts) = p.dim();
    if op.k == 0 || op.k > experts {
        return Err(kernel_err(
            name,
            format!("top {} of {experts} experts", op.k),
        ));
    }
    let chosen: Vec<Vec<usize>> = p
        .outer_iter()
        .map(|row| {
            let mut order: Vec<usize> = (0..experts).collect();
            // Largest first; NaN last; among equals the lower expert first (a stable sort).
            order.sort_by(|&a, &b| {
                let (a, b): (f64, f64) = (row[a].into(), row[b].into());
                b.partial_cmp(&a)
                    .unwrap_or_else(|| a.is_nan().cmp(&b.is_nan()))
            });
            order.truncate(op.k);
            order
        })
        .collect();
    let [ids, counts] = io.outputs else {
        return Err(kernel_err(
            name,
            format!("expects 2 outputs, got {}", io.outputs.len()),
        ));
    };
    let ids = i64::view_mut(ids)
        .filter(|a| a.shape() == [m, op.k])
        .ok_or_else(|| kernel_err(name, format!("output 0 is not i64 [{m}, {}]", op.k)))?;
    for (slot, &e) in ids.iter_mut().zip(chosen.iter().flatten()) {
        *slot = e as i64;
    }
    let counts = T::view_mut(counts)
        .filter(|a| a.len() == experts)
        .ok_or_else(|| kernel_err(name, format!("output 1 is not {} [{experts}]", T::DTYPE)))?;
    let mut n = vec![0usize; experts];
    chosen.iter().flatten().for_each(|&e| n[e] += 1);
    for (c, &n) in counts.iter_mut().zip(&n) {
        *c = T::narrow(<T::W as Wide>::constant(n as f64));
    }
    Ok(())
}

cpu_kernels_by_dtype! {
    [f32, f64, bf16];
    pub(super) fn expert_matmul(ExpertMatmul) => matmul_typed;
    pub(super) fn expert_matmul_wgrad(ExpertMatmulWgrad) => wgrad_typed;
}

cpu_kernels_by_dtype! {
    [f32, f64];
    pub(super) fn router_topk(RouterTopk) => topk_typed;
}
