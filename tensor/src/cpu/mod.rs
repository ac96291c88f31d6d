//! The CPU backend: kernels of every op family on host arrays (`CpuArray`: ndarray, rayon for
//! large arrays, matrixmultiply), one file per family, each implementing that family's kernel
//! trait for [`CpuBackend`].

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
use crate::op::{KernelBackend, OutSpec};
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
