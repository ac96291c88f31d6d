//! The rotary embedding's CPU kernel on host arrays: f32 and bf16 computed in f32 (bf16
//! rounded once per output element), f64 in f64; rows in parallel.

use half::bf16;
use oxiflow_tensor::{CpuBackend, ExternOp, KernelIo, Result};
use rayon::prelude::*;

use super::RotaryTables;
use crate::cpu_dispatch::cpu_kernels_by_dtype;
use crate::host_slices::{input, kernel_err, output, Elem, Wide};

fn rotate_typed<T: Elem>(op: &RotaryTables, io: KernelIo<'_, CpuBackend>) -> Result<()> {
    let name = op.name();
    let dims = io
        .inputs
        .first()
        .map(|a| a.shape().to_vec())
        .unwrap_or_default();
    let &[_, t, heads, d] = &dims[..] else {
        return Err(kernel_err(name, format!("x is {dims:?}, not [B, T, H, D]")));
    };
    let (x, c, s) = (
        input::<T>(name, io.inputs, 0)?,
        input::<T>(name, io.inputs, 1)?,
        input::<T>(name, io.inputs, 2)?,
    );
    if c.len() != t * d || s.len() != t * d || d % 2 != 0 {
        return Err(kernel_err(
            name,
            format!(
                "tables of {} and {} values for x {dims:?}",
                c.len(),
                s.len()
            ),
        ));
    }
    let y = output::<T>(name, io.outputs, 0, x.len())?;
    if d == 0 {
        return Ok(());
    }
    let half = d / 2;
    let sign = if op.inverse { -1.0 } else { 1.0 };
    y.par_chunks_mut(d)
        .zip(x.par_chunks(d))
        .enumerate()
        .for_each(|(row, (y, x))| {
            let at = (row / heads.max(1)) % t.max(1) * d;
            let (c, s) = (&c[at..at + d], &s[at..at + d]);
            for i in 0..half {
                let (x1, x2) = (x[i].widen(), x[i + half].widen());
                let (c1, c2) = (c[i].widen(), c[i + half].widen());
                // Forward: [x1 c1 - x2 s1, x2 c2 + x1 s2]; inverse: [x1 c1 + x2 s2, x2 c2 - x1 s1].
                let (s1, s2) = if op.inverse {
                    (s[i + half].widen(), s[i].widen())
                } else {
                    (s[i].widen(), s[i + half].widen())
                };
                let k = T::W::constant(sign);
                y[i] = T::narrow(x1 * c1 - k * x2 * s1);
                y[i + half] = T::narrow(x2 * c2 + k * x1 * s2);
            }
        });
    Ok(())
}

cpu_kernels_by_dtype! {
    [f32, f64, bf16];
    pub(super) fn rotate(RotaryTables) => rotate_typed;
}
