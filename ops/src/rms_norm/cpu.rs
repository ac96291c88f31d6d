//! RMS normalisation's CPU kernels on host arrays, a row at a time (rows in parallel when the
//! array is large): f32 and bf16 computed in f32 (bf16 rounded once per output element), f64
//! in f64.

use std::borrow::Cow;

use half::bf16;
use oxiflow_tensor::{CpuArray, CpuBackend, ExternOp, KernelIo, Result};
use rayon::prelude::*;

use super::{RmsNorm, RmsNormGrad};
use crate::cpu_dispatch::cpu_kernels_by_dtype;
use crate::host_slices::{input, kernel_err, output, output_pair, Elem, Wide, CHUNK};

/// `(mean(x^2) + eps)^-1/2` of one row.
fn rstd<T: Elem>(x: &[T], eps: f64) -> T::W {
    let ss = x
        .iter()
        .fold(T::W::constant(0.0), |s, &v| s + v.widen() * v.widen());
    let mean = ss / T::W::constant(x.len() as f64);
    T::W::constant(1.0) / (mean + T::W::constant(eps)).sqrt()
}

/// x and w as slices, and the row width.
type Rows<'a, T> = (Cow<'a, [T]>, Cow<'a, [T]>, usize);

/// x and w as slices, and the row width, or why they do not fit.
fn rows<'a, T: Elem>(op: &'static str, inputs: &'a [&'a CpuArray]) -> Result<Rows<'a, T>> {
    let (x, w) = (input::<T>(op, inputs, 0)?, input::<T>(op, inputs, 1)?);
    let h = w.len();
    if (h == 0 && !x.is_empty()) || (h > 0 && x.len() % h != 0) {
        return Err(kernel_err(
            op,
            format!("{} elements are no whole rows of the weight's {h}", x.len()),
        ));
    }
    Ok((x, w, h))
}

/// Whole rows per parallel chunk.
fn rows_per_chunk(h: usize) -> usize {
    (CHUNK / h.max(1)).max(1)
}

fn forward_typed<T: Elem>(op: &RmsNorm, io: KernelIo<'_, CpuBackend>) -> Result<()> {
    let name = op.name();
    let (x, w, h) = rows::<T>(name, io.inputs)?;
    let y = output::<T>(name, io.outputs, 0, x.len())?;
    if x.is_empty() {
        return Ok(());
    }
    let row = |(y, x): (&mut [T], &[T])| {
        let r = rstd(x, op.eps);
        for ((y, &x), &w) in y.iter_mut().zip(x).zip(w.iter()) {
            *y = T::narrow(x.widen() * r * w.widen());
        }
    };
    let per = rows_per_chunk(h);
    if x.len() >= CHUNK {
        y.par_chunks_mut(per * h)
            .zip(x.par_chunks(per * h))
            .for_each(|(y, x)| y.chunks_mut(h).zip(x.chunks(h)).for_each(row));
    } else {
        y.chunks_mut(h).zip(x.chunks(h)).for_each(row);
    }
    Ok(())
}

/// One backward row's outputs (dx, terms) beside its inputs (x, dy).
type RowsOut<'r, T> = ((&'r mut [T], &'r mut [<T as Elem>::W]), (&'r [T], &'r [T]));

/// `dx` and the weight-gradient terms `dy * xhat` of one row.
fn backward_row<T: Elem>(
    eps: f64,
    w: &[T],
    inv_h: T::W,
    dx: &mut [T],
    terms: &mut [T::W],
    x: &[T],
    dy: &[T],
) {
    let r = rstd(x, eps);
    // mean over the row of dy w xhat
    let mut proj = T::W::constant(0.0);
    for ((&x, &dy), &w) in x.iter().zip(dy).zip(w.iter()) {
        proj = proj + dy.widen() * w.widen() * (x.widen() * r);
    }
    proj = proj * inv_h;
    for i in 0..x.len() {
        let (xh, d) = (x[i].widen() * r, dy[i].widen());
        dx[i] = T::narrow(r * (d * w[i].widen() - xh * proj));
        terms[i] = d * xh;
    }
}

fn backward_typed<T: Elem>(op: &RmsNormGrad, io: KernelIo<'_, CpuBackend>) -> Result<()> {
    let name = op.name();
    let (x, w, h) = rows::<T>(name, io.inputs)?;
    let dy = input::<T>(name, io.inputs, 2)?;
    if dy.len() != x.len() {
        return Err(kernel_err(
            name,
            format!("{} gradients for {} elements", dy.len(), x.len()),
        ));
    }
    let (dx, terms) = output_pair::<T, T::W>(name, io.outputs, x.len())?;
    if x.is_empty() {
        return Ok(());
    }
    let inv_h = T::W::constant(1.0 / h as f64);
    let row =
        |((dx, terms), (x, dy)): RowsOut<'_, T>| backward_row(op.eps, &w, inv_h, dx, terms, x, dy);
    let per = rows_per_chunk(h) * h;
    if x.len() >= CHUNK {
        dx.par_chunks_mut(per)
            .zip(terms.par_chunks_mut(per))
            .zip(x.par_chunks(per).zip(dy.par_chunks(per)))
            .for_each(|((dx, t), (x, dy))| {
                dx.chunks_mut(h)
                    .zip(t.chunks_mut(h))
                    .zip(x.chunks(h).zip(dy.chunks(h)))
                    .for_each(row)
            });
    } else {
        dx.chunks_mut(h)
            .zip(terms.chunks_mut(h))
            .zip(x.chunks(h).zip(dy.chunks(h)))
            .for_each(row);
    }
    Ok(())
}

cpu_kernels_by_dtype! {
    [f32, f64, bf16];
    pub(super) fn forward(RmsNorm) => forward_typed;
    pub(super) fn backward(RmsNormGrad) => backward_typed;
}
