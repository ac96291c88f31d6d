//! The CPU backend: kernels of every op family on host arrays (`CpuArray`: ndarray, rayon for
//! large arrays, matrixmultiply), one file per family, each implementing that family's kernel
//! trait for [`CpuBackend`]. Dispatch runs them through [`run`], which widens 16-bit floats to
//! f32 around the kernel, so each kernel is written for f32, f64 and i64 only.

mod attention;
mod dropout;
mod elementwise;
mod embedding;
mod gather;
mod layout;
mod loss;
mod mask;
mod matmul;
mod norm;
mod piece;
mod reduction;
mod rms_norm;
mod rotary;
mod softmax;

use ndarray::{ArrayD, ArrayView2};

use crate::element::FloatElement;
use std::borrow::Cow;

use oxiflow_dtype::DType;
use smallvec::SmallVec;

use crate::op::{KernelBackend, Op, OutSpec};
use crate::storage::CpuArray;
use crate::{Result, TensorError};

pub(crate) use elementwise::PAR_THRESHOLD;
pub(crate) use piece::{array_of_host_piece, host_piece_of, CpuPiece};

/// The CPU backend (stateless: kernels run on the calling thread and rayon's pool).
#[derive(Clone, Copy, Debug, Default)]
pub struct CpuBackend;

impl KernelBackend for CpuBackend {
    type Piece = CpuArray;
}

/// Runs `op`'s CPU kernel on `inputs`, the one place where 16-bit floats meet the kernels:
/// 16-bit inputs are widened to f32 (exactly), the kernel computes in f32 (in f64 where an
/// input is f64), and an output of a 16-bit dtype is rounded once. Kernels themselves never
/// see a 16-bit array.
pub(crate) fn run(op: &Op, inputs: &[&CpuArray], out: &OutSpec) -> Result<CpuArray> {
    let half_in = inputs.iter().any(|a| a.dtype().is_half());
    if !half_in && !out.dtype.is_half() {
        return op.run(&CpuBackend, inputs, out);
    }
    let widened: SmallVec<[Cow<'_, CpuArray>; 3]> = inputs
        .iter()
        .map(|&a| match a.dtype().half() {
            Some(_) => Cow::Owned(a.cast(DType::F32)),
            None => Cow::Borrowed(a),
        })
        .collect();
    let refs: SmallVec<[&CpuArray; 3]> = widened.iter().map(|a| a.as_ref()).collect();
    let compute = match out.dtype.half() {
        Some(_) if inputs.iter().any(|a| a.dtype() == DType::F64) => DType::F64,
        Some(_) => DType::F32,
        None => out.dtype,
    };
    let spec = OutSpec {
        shape: out.shape.clone(),
        dtype: compute,
    };
    let y = op.run(&CpuBackend, &refs, &spec)?;
    Ok(if compute == out.dtype {
        y
    } else {
        y.cast(out.dtype)
    })
}

/// `a` viewed as rows of its last dim.
fn rows<F: FloatElement>(a: &ArrayD<F>) -> Option<ArrayView2<'_, F>> {
    let (&h, lead) = a.shape().split_last()?;
    a.view()
        .into_shape_with_order((lead.iter().product::<usize>(), h))
        .ok()
}

/// Every index lies in `0..num`.
fn check_ids(op: &'static str, ids: &ArrayD<i64>, num: usize) -> Result<()> {
    match ids.iter().find(|&&i| i < 0 || i as usize >= num) {
        Some(bad) => Err(crate::op::kernel_err(
            op,
            format!("index {bad} out of range 0..{num}"),
        )),
        None => Ok(()),
    }
}

/// The error of a kernel given an array it does not compute on: i64 where it needs a float, or
/// a 16-bit float, which reaches kernels only as f32 (see `run`).
fn float_input(op: &'static str, a: &CpuArray) -> TensorError {
    let detail = if a.dtype().is_half() {
        format!(
            "a {} array reached the kernel; 16-bit floats run as f32",
            a.dtype()
        )
    } else {
        format!("needs a float input, got {}", a.dtype())
    };
    TensorError::Kernel { op, detail }
}

/// The kernel result in standard layout, checked against what the dispatcher expects.
fn checked(op: &'static str, a: CpuArray, out: &OutSpec) -> Result<CpuArray> {
    let a = a.into_standard();
    if a.shape() != out.shape.dims() || a.dtype() != out.dtype {
        return Err(TensorError::Kernel {
            op,
            detail: format!(
                "cpu kernel gave {} {:?} where {} {} was expected",
                a.dtype(),
                a.shape(),
                out.dtype,
                out.shape
            ),
        });
    }
    Ok(a)
}
