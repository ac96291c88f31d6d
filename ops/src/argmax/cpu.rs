//! The arg-max's CPU kernel: a `>`-scan of each row from `(0, -inf)` (see the module docs),
//! rows in parallel.

use half::{bf16, f16};
use oxiflow_tensor::{CpuBackend, KernelIo, Result, TensorElement};
use rayon::prelude::*;

use super::ArgMax;
use crate::cpu_dispatch::cpu_kernels_by_dtype;
use crate::host_slices::{input, kernel_err, output};

/// The first index of the largest value of `row` above -inf, else 0.
pub(crate) fn first_largest(row: impl Iterator<Item = f64>) -> usize {
    row.enumerate()
        .fold(
            (0, f64::NEG_INFINITY),
            |a, (i, v)| if v > a.1 { (i, v) } else { a },
        )
        .0
}

fn typed<T: TensorElement + Copy + Send + Sync + Into<f64>>(
    op: &'static str,
    io: KernelIo<'_, CpuBackend>,
) -> Result<()> {
    let (x, out) = (io.inputs, io.outputs);
    let n = x
        .first()
        .map_or(0, |a| a.shape().last().copied().unwrap_or(0));
    let v = input::<T>(op, x, 0)?;
    if n == 0 || v.len() % n != 0 {
        return Err(kernel_err(
            op,
            format!("{} elements in rows of {n}", v.len()),
        ));
    }
    let y = output::<i64>(op, out, 0, v.len() / n)?;
    y.par_iter_mut()
        .zip(v.par_chunks(n))
        .for_each(|(y, row)| *y = first_largest(row.iter().map(|&e| e.into())) as i64);
    Ok(())
}

cpu_kernels_by_dtype! {
    [f32, f64, bf16, f16];
    pub(super) fn argmax(ArgMax) => typed(name);
}
