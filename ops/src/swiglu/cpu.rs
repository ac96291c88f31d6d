//! SwiGLU's CPU kernels on host arrays: f32 and bf16 computed in f32 (bf16 rounded once per
//! output element), f64 in f64; large arrays in parallel chunks.

use half::bf16;
use oxiflow_tensor::{CpuBackend, KernelIo, Result};
use rayon::prelude::*;

use super::{SwiGlu, SwiGluGrad, SwiGluPairs};
use crate::cpu_dispatch::cpu_kernels_by_dtype;
use crate::host_slices::{input, kernel_err, output, output_pair, Elem, Wide, CHUNK};

/// `silu(g) * u`.
fn silu_times<W: Wide>(g: W, u: W) -> W {
    g * g.sigmoid() * u
}

/// (dgate, dup) of `silu(g) * u` for output gradient `d`: `d * u * s * (1 + g * (1 - s))` and
/// `d * g * s`, with `s = sigmoid(g)`.
fn grads<W: Wide>(g: W, u: W, d: W) -> (W, W) {
    let (s, one) = (g.sigmoid(), W::constant(1.0));
    let ds = s * (one + g * (one - s));
    (d * u * ds, d * (g * s))
}

fn forward_typed<T: Elem>(op: &'static str, io: KernelIo<'_, CpuBackend>) -> Result<()> {
    let (g, u) = (input::<T>(op, io.inputs, 0)?, input::<T>(op, io.inputs, 1)?);
    if g.len() != u.len() {
        return Err(kernel_err(
            op,
            format!("{} gates for {} ups", g.len(), u.len()),
        ));
    }
    let y = output::<T>(op, io.outputs, 0, g.len())?;
    let f = |(y, (g, u)): (&mut T, (&T, &T))| *y = T::narrow(silu_times(g.widen(), u.widen()));
    if y.len() >= CHUNK {
        y.par_chunks_mut(CHUNK)
            .zip(g.par_chunks(CHUNK).zip(u.par_chunks(CHUNK)))
            .for_each(|(y, (g, u))| y.iter_mut().zip(g.iter().zip(u)).for_each(f));
    } else {
        y.iter_mut().zip(g.iter().zip(u.iter())).for_each(f);
    }
    Ok(())
}

fn backward_typed<T: Elem>(op: &'static str, io: KernelIo<'_, CpuBackend>) -> Result<()> {
    let g = input::<T>(op, io.inputs, 0)?;
    let u = input::<T>(op, io.inputs, 1)?;
    let d = input::<T>(op, io.inputs, 2)?;
    let n = g.len();
    if u.len() != n || d.len() != n {
        return Err(kernel_err(
            op,
            format!("{n} gates, {} ups and {} gradients", u.len(), d.len()),
        ));
    }
    let (dg, du) = output_pair::<T, T>(op, io.outputs, n)?;
    let run = |dg: &mut [T], du: &mut [T], g: &[T], u: &[T], d: &[T]| {
        for i in 0..dg.len() {
            let (a, b) = grads(g[i].widen(), u[i].widen(), d[i].widen());
            (dg[i], du[i]) = (T::narrow(a), T::narrow(b));
        }
    };
    if n >= CHUNK {
        dg.par_chunks_mut(CHUNK)
            .zip(du.par_chunks_mut(CHUNK))
            .enumerate()
            .for_each(|(k, (dg, du))| {
                let at = k * CHUNK..k * CHUNK + dg.len();
                run(dg, du, &g[at.clone()], &u[at.clone()], &d[at]);
            });
    } else {
        run(dg, du, &g, &u, &d);
    }
    Ok(())
}

cpu_kernels_by_dtype! {
    [f32, f64, bf16];
    pub(super) fn forward(SwiGlu) => forward_typed(name);
    pub(super) fn backward(SwiGluGrad) => backward_typed(name);
    pub(super) fn pairs(SwiGluPairs) => pairs_typed(name);
}

fn pairs_typed<T: Elem>(op: &'static str, io: KernelIo<'_, CpuBackend>) -> Result<()> {
    let x = input::<T>(op, io.inputs, 0)?;
    if x.len() % 2 != 0 {
        return Err(kernel_err(op, format!("{} elements are no pairs", x.len())));
    }
    let y = output::<T>(op, io.outputs, 0, x.len() / 2)?;
    let f = |(y, p): (&mut T, &[T])| *y = T::narrow(silu_times(p[0].widen(), p[1].widen()));
    if y.len() >= CHUNK {
        y.par_chunks_mut(CHUNK)
            .zip(x.par_chunks(2 * CHUNK))
            .for_each(|(y, x)| y.iter_mut().zip(x.chunks_exact(2)).for_each(f));
    } else {
        y.iter_mut().zip(x.chunks_exact(2)).for_each(f);
    }
    Ok(())
}
