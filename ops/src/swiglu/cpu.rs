//! SwiGLU's CPU kernels on host arrays: f32 and bf16 computed in f32 (bf16 rounded once per
//! output element), f64 in f64; large arrays in parallel chunks.

use std::borrow::Cow;

use half::bf16;
use ndarray::ArrayD;
use oxiflow_tensor::{CpuArray, CpuBackend, KernelIo, Result, TensorError};
use rayon::prelude::*;

use super::{SwiGlu, SwiGluGrad};
use crate::host_float::HostFloat as Elem;

/// Elements per parallel chunk.
const CHUNK: usize = 1 << 14;

/// Arithmetic the kernels compute in (f32 for f32 and bf16, f64 for f64).
trait Wide: Copy + Send + Sync {
    fn sigmoid(self) -> Self;
    fn one() -> Self;
    fn mul(self, o: Self) -> Self;
    fn sub(self, o: Self) -> Self;
    fn add(self, o: Self) -> Self;
}

macro_rules! wide {
    ($t:ty) => {
        impl Wide for $t {
            fn sigmoid(self) -> Self {
                1.0 / (1.0 + (-self).exp())
            }
            fn one() -> Self {
                1.0
            }
            fn mul(self, o: Self) -> Self {
                self * o
            }
            fn sub(self, o: Self) -> Self {
                self - o
            }
            fn add(self, o: Self) -> Self {
                self + o
            }
        }
    };
}
wide!(f32);
wide!(f64);

/// `silu(g) * u`.
fn silu_times<W: Wide>(g: W, u: W) -> W {
    g.mul(g.sigmoid()).mul(u)
}

/// (dgate, dup) of `silu(g) * u` for output gradient `d`: `d * u * s * (1 + g * (1 - s))` and
/// `d * g * s`, with `s = sigmoid(g)`.
fn grads<W: Wide>(g: W, u: W, d: W) -> (W, W) {
    let s = g.sigmoid();
    let ds = s.mul(W::one().add(g.mul(W::one().sub(s))));
    (d.mul(u).mul(ds), d.mul(g.mul(s)))
}

fn kernel_err(op: &'static str, detail: String) -> TensorError {
    TensorError::Kernel { op, detail }
}

/// Input `i` as a row-major slice of `T`.
fn input<'a, T: Elem>(op: &'static str, x: &'a [&'a CpuArray], i: usize) -> Result<Cow<'a, [T]>> {
    let a = x
        .get(i)
        .and_then(|a| T::view(a))
        .ok_or_else(|| kernel_err(op, format!("input {i} is not {}", T::DTYPE)))?;
    Ok(match a.as_slice() {
        Some(s) => Cow::Borrowed(s),
        None => Cow::Owned(a.iter().copied().collect()),
    })
}

/// Output `i` as a row-major slice of `T` holding `n` elements.
fn output<'a, T: Elem>(
    op: &'static str,
    out: &'a mut [CpuArray],
    i: usize,
    n: usize,
) -> Result<&'a mut [T]> {
    let a: &mut ArrayD<T> = out
        .get_mut(i)
        .and_then(|o| T::view_mut(o))
        .ok_or_else(|| kernel_err(op, format!("output {i} is not {}", T::DTYPE)))?;
    let got = a.len();
    a.as_slice_mut()
        .filter(|s| s.len() == n)
        .ok_or_else(|| kernel_err(op, format!("output {i} holds {got} elements, inputs {n}")))
}

fn forward_typed<T: Elem>(op: &'static str, io: KernelIo<'_, CpuBackend>) -> Result<()>
where
    T::W: Wide,
{
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

fn backward_typed<T: Elem>(op: &'static str, io: KernelIo<'_, CpuBackend>) -> Result<()>
where
    T::W: Wide,
{
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
    let [dg, du] = io.outputs else {
        return Err(kernel_err(
            op,
            format!("expects 2 outputs, got {}", io.outputs.len()),
        ));
    };
    let dg = output::<T>(op, std::slice::from_mut(dg), 0, n)?;
    let du = output::<T>(op, std::slice::from_mut(du), 0, n)?;
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

pub(super) fn forward(op: &SwiGlu, _b: &CpuBackend, io: KernelIo<'_, CpuBackend>) -> Result<()> {
    let name = oxiflow_tensor::ExternOp::name(op);
    match io.inputs.first().map(|a| a.dtype()) {
        Some(oxiflow_tensor::DType::F32) => forward_typed::<f32>(name, io),
        Some(oxiflow_tensor::DType::F64) => forward_typed::<f64>(name, io),
        Some(oxiflow_tensor::DType::BF16) => forward_typed::<bf16>(name, io),
        d => Err(kernel_err(name, format!("no CPU kernel for {d:?}"))),
    }
}

pub(super) fn backward(
    op: &SwiGluGrad,
    _b: &CpuBackend,
    io: KernelIo<'_, CpuBackend>,
) -> Result<()> {
    let name = oxiflow_tensor::ExternOp::name(op);
    match io.inputs.first().map(|a| a.dtype()) {
        Some(oxiflow_tensor::DType::F32) => backward_typed::<f32>(name, io),
        Some(oxiflow_tensor::DType::F64) => backward_typed::<f64>(name, io),
        Some(oxiflow_tensor::DType::BF16) => backward_typed::<bf16>(name, io),
        d => Err(kernel_err(name, format!("no CPU kernel for {d:?}"))),
    }
}
