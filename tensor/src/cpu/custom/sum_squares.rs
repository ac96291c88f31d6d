//! Multi-tensor sum of squares CPU kernel: each input's squares (rounded to f32, f64 for f64
//! data) summed in f64 over fixed chunks of its
//! elements in logical order (chunks in parallel when large, their sums added in order, so
//! every run gives the same bits), into the executor's f64 buffers.

use ndarray::ArrayD;
use oxiflow_dtype::{DType, Element};
use rayon::prelude::*;

use crate::cpu::{CpuBackend, PAR_THRESHOLD};
use crate::op::custom::{SumSquares, SumSquaresKernels, SumTerm};
use crate::op::{kernel_err, OpFamily};
use crate::storage::CpuArray;
use crate::{with_array, Result};

/// The sum of `term` over `a`'s elements in logical order, chunk by chunk; a square is
/// rounded to f32 (f64 for f64 data) before it is added.
fn sum_of<T: Element>(a: &ArrayD<T>, term: SumTerm) -> f64 {
    let wide = T::DTYPE == DType::F64;
    let f = move |v: &T| {
        let x = v.to_f64();
        match term {
            SumTerm::Square if wide => x * x,
            SumTerm::Square => {
                let y = x as f32;
                f64::from(y * y)
            }
            SumTerm::TimesZero => x * 0.0,
        }
    };
    let chunk_sum = |c: &[T]| c.iter().map(f).fold(0.0, |s, t| s + t);
    match a.as_slice() {
        Some(s) if s.len() >= PAR_THRESHOLD => {
            let parts: Vec<f64> = s.par_chunks(PAR_THRESHOLD).map(chunk_sum).collect();
            parts.iter().fold(0.0, |s, t| s + t)
        }
        Some(s) => chunk_sum(s),
        None => a.iter().map(f).fold(0.0, |s, t| s + t),
    }
}

impl SumSquaresKernels for CpuBackend {
    fn sum_squares(&self, op: &SumSquares, x: &[&CpuArray], out: &mut [CpuArray]) -> Result<()> {
        let mut each = Vec::with_capacity(x.len());
        for (i, a) in x.iter().enumerate() {
            if !a.dtype().is_float() {
                return Err(kernel_err(
                    op.name(),
                    format!("input {i} is {}, not a float dtype", a.dtype()),
                ));
            }
            each.push(with_array!(*a, v => sum_of(v, op.term)));
        }
        let total = each.iter().fold(0.0, |s, t| s + t);
        let [CpuArray::F64(e), CpuArray::F64(t)] = out else {
            return Err(kernel_err(
                op.name(),
                format!(
                    "expects two f64 output buffers, got {:?}",
                    out.iter().map(CpuArray::dtype).collect::<Vec<_>>()
                ),
            ));
        };
        if e.len() != each.len() || t.len() != 1 {
            return Err(kernel_err(
                op.name(),
                format!(
                    "{} inputs need outputs [{}] and [], got {:?} and {:?}",
                    each.len(),
                    each.len(),
                    e.shape(),
                    t.shape()
                ),
            ));
        }
        for (o, v) in e.iter_mut().zip(&each) {
            *o = *v;
        }
        t.fill(total);
        Ok(())
    }
}
