//! The CPU kernel: each input's squares (rounded to f32, f64 for f64 data) summed in f64 over
//! fixed chunks of its elements in logical order (chunks in parallel when large, their sums
//! added in order, so every run gives the same bits), into the executor's f64 buffers. Inputs
//! of every float dtype are read as they are.

use ndarray::ArrayD;
use oxiflow_dtype::{DType, Element};
use oxiflow_tensor::{with_array, CpuArray, CpuBackend, ExternOp, KernelIo, Result, TensorError};
use rayon::prelude::*;

use super::{SumSquares, SumTerm};

/// Elements per chunk: chunks are summed in parallel, then added in order.
const CHUNK: usize = 1 << 15;

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
        Some(s) if s.len() >= CHUNK => {
            let parts: Vec<f64> = s.par_chunks(CHUNK).map(chunk_sum).collect();
            parts.iter().fold(0.0, |s, t| s + t)
        }
        Some(s) => chunk_sum(s),
        None => a.iter().map(f).fold(0.0, |s, t| s + t),
    }
}

fn kernel_err(op: &SumSquares, detail: String) -> TensorError {
    TensorError::Kernel {
        op: op.name(),
        detail,
    }
}

pub(super) fn sum_squares(
    op: &SumSquares,
    _b: &CpuBackend,
    io: KernelIo<'_, CpuBackend>,
) -> Result<()> {
    let mut each = Vec::with_capacity(io.inputs.len());
    for (i, a) in io.inputs.iter().enumerate() {
        if !a.dtype().is_float() {
            return Err(kernel_err(
                op,
                format!("input {i} is {}, not a float dtype", a.dtype()),
            ));
        }
        each.push(with_array!(*a, v => sum_of(v, op.term)));
    }
    let total = each.iter().fold(0.0, |s, t| s + t);
    let [CpuArray::F64(e), CpuArray::F64(t)] = io.outputs else {
        return Err(kernel_err(
            op,
            format!(
                "expects two f64 output buffers, got {:?}",
                io.outputs.iter().map(CpuArray::dtype).collect::<Vec<_>>()
            ),
        ));
    };
    if e.len() != each.len() || t.len() != 1 {
        return Err(kernel_err(
            op,
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
