//! Matrix multiplication CPU kernels: a [.., k] x b [k, n] (matrixmultiply through ndarray,
//! row blocks on rayon when large) and batch matmul (rayon over batches).

use ndarray::linalg::general_mat_mul;
use ndarray::{Array2, Array3, ArrayD, Axis, Ix2, Ix3, IxDyn, Zip};

use ndarray::parallel::prelude::*;

use super::{checked, CpuBackend};
use crate::element::TensorElement;
use crate::op::{MatmulKernels, OutSpec};
use crate::storage::CpuArray;
use crate::{Result, TensorError};

/// Work (m * k * n) above which a single matmul is split into row blocks on rayon.
const PAR_WORK: usize = 1 << 21;

fn err(op: &'static str, a: &[usize], b: &[usize]) -> TensorError {
    TensorError::Kernel {
        op,
        detail: format!("local pieces {a:?} and {b:?} do not multiply"),
    }
}

fn mm<T: TensorElement>(a: &ArrayD<T>, b: &ArrayD<T>) -> Option<ArrayD<T>> {
    let k = *a.shape().last()?;
    let m: usize = a.shape()[..a.ndim() - 1].iter().product();
    let a2 = a.view().into_shape_with_order((m, k)).ok()?;
    let b2 = b.view().into_dimensionality::<Ix2>().ok()?;
    let n = b2.ncols();
    if b2.nrows() != k {
        return None;
    }
    let mut out = Array2::<T>::zeros((m, n));
    if m * k * n >= PAR_WORK && m >= 2 {
        let threads = rayon::current_num_threads().max(1);
        let rows = m.div_ceil(threads * 2).max(1);
        out.axis_chunks_iter_mut(Axis(0), rows)
            .into_par_iter()
            .zip(a2.axis_chunks_iter(Axis(0), rows).into_par_iter())
            .for_each(|(mut o, a)| general_mat_mul(T::one(), &a, &b2, T::from_f64(0.0), &mut o));
    } else {
        general_mat_mul(T::one(), &a2, &b2, T::from_f64(0.0), &mut out);
    }
    let mut shape = a.shape().to_vec();
    if let Some(l) = shape.last_mut() {
        *l = n;
    }
    out.into_shape_with_order(IxDyn(&shape)).ok()
}

/// a [.., k] x b [k, n] -> [.., n].
pub fn matmul(a: &CpuArray, b: &CpuArray) -> Result<CpuArray> {
    let out = match (a, b) {
        (CpuArray::F32(x), CpuArray::F32(y)) => mm(x, y).map(CpuArray::F32),
        (CpuArray::F64(x), CpuArray::F64(y)) => mm(x, y).map(CpuArray::F64),
        (CpuArray::I64(x), CpuArray::I64(y)) => mm(x, y).map(CpuArray::I64),
        _ => None,
    };
    out.ok_or_else(|| err("matmul", a.shape(), b.shape()))
}

fn bmm<T: TensorElement>(a: &ArrayD<T>, b: &ArrayD<T>) -> Option<ArrayD<T>> {
    let nd = a.ndim();
    if nd < 3 || b.ndim() != nd {
        return None;
    }
    let (m, k, n) = (a.shape()[nd - 2], a.shape()[nd - 1], b.shape()[nd - 1]);
    let batch: usize = a.shape()[..nd - 2].iter().product();
    let a3 = a.view().into_shape_with_order((batch, m, k)).ok()?;
    let b3 = b.view().into_shape_with_order((batch, k, n)).ok()?;
    let mut out = Array3::<T>::zeros((batch, m, n));
    let z = Zip::from(out.outer_iter_mut())
        .and(a3.outer_iter())
        .and(b3.outer_iter());
    let f =
        |mut o: ndarray::ArrayViewMut2<T>, x: ndarray::ArrayView2<T>, y: ndarray::ArrayView2<T>| {
            general_mat_mul(T::one(), &x, &y, T::from_f64(0.0), &mut o)
        };
    if batch > 1 && batch * m * k * n >= PAR_WORK / 8 {
        z.par_for_each(f);
    } else {
        z.for_each(f);
    }
    let mut shape = a.shape().to_vec();
    shape[nd - 1] = n;
    out.into_dimensionality::<Ix3>()
        .ok()?
        .into_shape_with_order(IxDyn(&shape))
        .ok()
}

/// a [b.., m, k] x b [b.., k, n] -> [b.., m, n].
pub fn batch_matmul(a: &CpuArray, b: &CpuArray) -> Result<CpuArray> {
    let out = match (a, b) {
        (CpuArray::F32(x), CpuArray::F32(y)) => bmm(x, y).map(CpuArray::F32),
        (CpuArray::F64(x), CpuArray::F64(y)) => bmm(x, y).map(CpuArray::F64),
        (CpuArray::I64(x), CpuArray::I64(y)) => bmm(x, y).map(CpuArray::I64),
        _ => None,
    };
    out.ok_or_else(|| err("batch_matmul", a.shape(), b.shape()))
}

impl MatmulKernels for CpuBackend {
    fn matmul(&self, a: &CpuArray, b: &CpuArray, out: &OutSpec) -> Result<CpuArray> {
        checked("matmul", matmul(a, b)?, out)
    }
    fn batch_matmul(&self, a: &CpuArray, b: &CpuArray, out: &OutSpec) -> Result<CpuArray> {
        checked("batch_matmul", batch_matmul(a, b)?, out)
    }
    fn matmul_t(
        &self,
        a: &CpuArray,
        b: &CpuArray,
        (ta, tb): (bool, bool),
        batched: bool,
        out: &OutSpec,
    ) -> Result<CpuArray> {
        // Transposed operands are copied here (the device kernels use gemm flags instead).
        let t = |x: &CpuArray, on: bool| -> Option<CpuArray> {
            let n = x.shape().len();
            (on && n >= 2).then(|| {
                let mut perm: Vec<usize> = (0..n).collect();
                perm.swap(n - 2, n - 1);
                super::layout::permute(x, &perm)
            })
        };
        let (at, bt) = (t(a, ta), t(b, tb));
        let (a, b) = (at.as_ref().unwrap_or(a), bt.as_ref().unwrap_or(b));
        if batched {
            checked("batch_matmul_t", batch_matmul(a, b)?, out)
        } else {
            checked("matmul_t", matmul(a, b)?, out)
        }
    }
}
