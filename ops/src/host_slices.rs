//! What the CPU kernels of this crate share: row-major slices of the host arrays a kernel gets
//! (borrowed when contiguous), typed by an element type, and the arithmetic each element type
//! computes in (`Wide`: f32 for f32 and bf16, f64 for f64), with the typed kernel error, and
//! the core's way of running an f32 kernel on 16-bit data ([`through_wide`]).

use std::borrow::Cow;
use std::ops::{Add, Div, Mul, Neg, Sub};

use half::{bf16, f16};
use ndarray::ArrayD;
use oxiflow_dtype::DType;
use oxiflow_tensor::backend::ElementwiseKernels;
use oxiflow_tensor::{CpuArray, CpuBackend, KernelFn, KernelIo, Result, TensorElement};

use crate::kernel_io::io_arrays;

/// Elements per parallel chunk of an element-wise kernel.
pub(crate) const CHUNK: usize = 1 << 14;

/// Arithmetic a kernel computes in.
pub(crate) trait Wide:
    TensorElement
    + Copy
    + Send
    + Sync
    + Add<Output = Self>
    + Sub<Output = Self>
    + Mul<Output = Self>
    + Div<Output = Self>
    + Neg<Output = Self>
    + PartialOrd
{
    fn constant(v: f64) -> Self;
    fn exp(self) -> Self;
    fn ln(self) -> Self;
    fn sqrt(self) -> Self;
    fn sigmoid(self) -> Self {
        Self::constant(1.0) / (Self::constant(1.0) + (-self).exp())
    }
}

/// `Wide` for a primitive float type: its own arithmetic.
macro_rules! wide_float {
    ($($t:ident),*) => {$(
        impl Wide for $t {
            fn constant(v: f64) -> $t {
                v as $t
            }
            fn exp(self) -> $t {
                $t::exp(self)
            }
            fn ln(self) -> $t {
                $t::ln(self)
            }
            fn sqrt(self) -> $t {
                $t::sqrt(self)
            }
        }
    )*};
}

wide_float!(f32, f64);

/// An element type and the arithmetic its kernels compute in.
pub(crate) trait Elem: TensorElement + Copy + Send + Sync {
    type W: Wide;
    fn widen(self) -> Self::W;
    fn narrow(w: Self::W) -> Self;
}

/// `Elem` for a primitive float type: computed in itself.
macro_rules! elem_as_wide {
    ($($t:ident),*) => {$(
        impl Elem for $t {
            type W = $t;
            fn widen(self) -> $t {
                self
            }
            fn narrow(w: $t) -> $t {
                w
            }
        }
    )*};
}

/// `Elem` for a 16-bit float type: computed in f32.
macro_rules! elem_through_f32 {
    ($($t:ident),*) => {$(
        impl Elem for $t {
            type W = f32;
            fn widen(self) -> f32 {
                self.to_f32()
            }
            fn narrow(w: f32) -> $t {
                $t::from_f32(w)
            }
        }
    )*};
}

elem_as_wide!(f32, f64);
elem_through_f32!(bf16, f16);

/// Runs `kernel` on `x` into `out` as the core's CPU backend runs its own kernels on 16-bit
/// data: 16-bit inputs widened to f32, each 16-bit output computed in f32 (f64 where an input
/// is f64) and rounded once into its buffer; without 16-bit data, `kernel` as it is.
pub(crate) fn through_wide(
    x: &[&CpuArray],
    out: &mut [CpuArray],
    kernel: impl FnOnce(&[&CpuArray], &mut [CpuArray]) -> Result<()>,
) -> Result<()> {
    let half = x.iter().any(|a| a.dtype().is_half()) || out.iter().any(|o| o.dtype().is_half());
    if !half {
        return kernel(x, out);
    }
    let wide = if x.iter().any(|a| a.dtype() == DType::F64) {
        DType::F64
    } else {
        DType::F32
    };
    let widened: Vec<Cow<'_, CpuArray>> = x
        .iter()
        .map(|&a| match a.dtype().is_half() {
            true => Cow::Owned(a.cast(DType::F32)),
            false => Cow::Borrowed(a),
        })
        .collect();
    let refs: Vec<&CpuArray> = widened.iter().map(|a| a.as_ref()).collect();
    let mut computed: Vec<CpuArray> = out
        .iter()
        .map(|o| match o.dtype().is_half() {
            true => CpuArray::zeros(wide, o.shape()),
            false => CpuArray::zeros(o.dtype(), o.shape()),
        })
        .collect();
    kernel(&refs, &mut computed)?;
    // Into the executor's own buffers (it may own their memory): each rounded once.
    for (y, o) in computed.iter().zip(out.iter_mut()) {
        CpuBackend.cast(y, o)?;
    }
    Ok(())
}

/// Kernel `run` of op `op` on the CPU with 16-bit data through f32 ([`through_wide`]).
pub(crate) fn wide_kernel<O>(
    op: &O,
    b: &CpuBackend,
    io: KernelIo<'_, CpuBackend>,
    run: KernelFn<O, CpuBackend>,
) -> Result<()> {
    through_wide(io.inputs, io.outputs, |inputs, outputs| {
        let scratch = &mut [];
        run(
            op,
            b,
            KernelIo {
                inputs,
                outputs,
                scratch,
            },
        )
    })
}

/// `kernel` of op `op` on its `I` inputs and `N` output buffers (see [`io_arrays`]) on the
/// CPU, with 16-bit data through f32 ([`through_wide`]).
pub(crate) fn wide_arrays<const I: usize, const N: usize>(
    op: &'static str,
    io: KernelIo<'_, CpuBackend>,
    kernel: impl FnOnce([&CpuArray; I], &mut [CpuArray; N]) -> Result<()>,
) -> Result<()> {
    through_wide(io.inputs, io.outputs, |x, out| {
        let (x, out) = io_arrays(op, x, out)?;
        kernel(x, out)
    })
}

pub(crate) use oxiflow_tensor::backend::kernel_err;

/// Input `i` as an array of `T`.
pub(crate) fn input_array<'a, T: TensorElement>(
    op: &'static str,
    x: &'a [&'a CpuArray],
    i: usize,
) -> Result<&'a ArrayD<T>> {
    x.get(i)
        .and_then(|a| T::view(a))
        .ok_or_else(|| kernel_err(op, format!("input {i} is not {}", T::DTYPE)))
}

/// Output `i` as an array of `T`.
pub(crate) fn output_array<'a, T: TensorElement>(
    op: &'static str,
    out: &'a mut [CpuArray],
    i: usize,
) -> Result<&'a mut ArrayD<T>> {
    out.get_mut(i)
        .and_then(|o| T::view_mut(o))
        .ok_or_else(|| kernel_err(op, format!("output {i} is not {}", T::DTYPE)))
}

/// Input `i` as a row-major slice of `T`.
pub(crate) fn input<'a, T: TensorElement + Copy>(
    op: &'static str,
    x: &'a [&'a CpuArray],
    i: usize,
) -> Result<Cow<'a, [T]>> {
    let a = input_array::<T>(op, x, i)?;
    Ok(match a.as_slice() {
        Some(s) => Cow::Borrowed(s),
        None => Cow::Owned(a.iter().copied().collect()),
    })
}

/// Output `i` as a row-major slice of `T` holding `n` elements.
pub(crate) fn output<'a, T: TensorElement>(
    op: &'static str,
    out: &'a mut [CpuArray],
    i: usize,
    n: usize,
) -> Result<&'a mut [T]> {
    let a = output_array::<T>(op, out, i)?;
    let got = a.len();
    a.as_slice_mut()
        .filter(|s| s.len() == n)
        .ok_or_else(|| kernel_err(op, format!("output {i} holds {got} elements, inputs {n}")))
}

/// Outputs 0 and 1 as row-major slices of `A` and `B` holding `n` elements each.
pub(crate) fn output_pair<'a, A: TensorElement, B: TensorElement>(
    op: &'static str,
    out: &'a mut [CpuArray],
    n: usize,
) -> Result<(&'a mut [A], &'a mut [B])> {
    let [a, b] = out else {
        return Err(kernel_err(
            op,
            format!("expects 2 outputs, got {}", out.len()),
        ));
    };
    Ok((
        output::<A>(op, std::slice::from_mut(a), 0, n)?,
        output::<B>(op, std::slice::from_mut(b), 0, n)?,
    ))
}
