//! The CPU backend: kernels of every op family on host arrays (`CpuArray`: ndarray, rayon for
//! large arrays, matrixmultiply), one file per family, each implementing that family's kernel
//! trait for [`CpuBackend`].

mod attention;
mod custom;
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

use ndarray::{ArrayD, ArrayView2, IxDyn};
use oxiflow_collectives::DType;
use oxiflow_sbp::Shape;

use crate::element::{FloatElement, TensorElement};
use crate::op::{kernel_err, KernelBackend, OutSpec};
use crate::storage::CpuArray;
use crate::{with_array, Result};

pub(crate) use elementwise::PAR_THRESHOLD;
pub(crate) use piece::{array_of_host_piece, host_piece_of, CpuPiece};

/// Output buffers of at least this many elements come zeroed from the system (`calloc`);
/// smaller ones are filled after a plain allocation, which takes the allocator's fast path.
const ZEROED_PAGES: usize = 1 << 12;

/// The CPU backend (stateless: kernels run on the calling thread and rayon's pool).
#[derive(Clone, Copy, Debug, Default)]
pub struct CpuBackend;

impl KernelBackend for CpuBackend {
    type Piece = CpuArray;
    type Out = CpuArray;
    /// Zeros, row-major: a filled allocation when small (the allocator's fast path), zeroed
    /// pages when large.
    fn alloc(&self, spec: &OutSpec) -> Result<CpuArray> {
        fn zeros<T: TensorElement>(shape: &[usize]) -> Option<CpuArray> {
            let n = shape.iter().try_fold(1usize, |a, &d| a.checked_mul(d))?;
            let zero = T::from_f64(0.0);
            let v = if n < ZEROED_PAGES {
                let mut v = Vec::with_capacity(n);
                v.resize(n, zero);
                v
            } else {
                vec![zero; n]
            };
            ArrayD::from_shape_vec(IxDyn(shape), v).ok().map(T::wrap)
        }
        let dims = spec.shape.dims();
        let out = match spec.dtype {
            DType::F32 => zeros::<f32>(dims),
            DType::F64 => zeros::<f64>(dims),
            DType::I64 => zeros::<i64>(dims),
        };
        out.ok_or_else(|| kernel_err("alloc", format!("{} {} overflows", spec.dtype, spec.shape)))
    }
    fn out_spec(&self, out: &CpuArray) -> OutSpec {
        OutSpec {
            shape: Shape::from(out.shape()),
            dtype: out.dtype(),
        }
    }
    fn finish(&self, out: CpuArray) -> CpuArray {
        out
    }
    /// A copy: host pieces own their arrays.
    fn reshaped(&self, x: &CpuArray, spec: &OutSpec) -> Result<CpuArray> {
        let n: usize = x.shape().iter().product();
        if spec.shape.checked_numel() != Some(n) || spec.dtype != x.dtype() {
            return Err(kernel_err(
                "reshape",
                format!(
                    "cannot view {} {:?} as {} {}",
                    x.dtype(),
                    x.shape(),
                    spec.dtype,
                    spec.shape
                ),
            ));
        }
        fn to<T: TensorElement>(a: &ArrayD<T>, shape: &[usize]) -> Option<ArrayD<T>> {
            a.as_standard_layout()
                .into_owned()
                .into_shape_with_order(IxDyn(shape))
                .ok()
        }
        let out = with_array!(x, a => to(a, spec.shape.dims()).map(wrap));
        out.ok_or_else(|| kernel_err("reshape", format!("cannot reshape {:?}", x.shape())))
    }
}

/// An owned array as a `CpuArray`.
fn wrap<T: TensorElement>(a: ArrayD<T>) -> CpuArray {
    T::wrap(a)
}

/// `out` as an array of `T`, or a typed error naming `op` when it holds another dtype.
fn out_as<'a, T: TensorElement>(
    op: &'static str,
    out: &'a mut CpuArray,
) -> Result<&'a mut ArrayD<T>> {
    let dt = out.dtype();
    T::view_mut(out).ok_or_else(|| {
        kernel_err(
            op,
            format!("output buffer is {dt}, the kernel writes {}", T::DTYPE),
        )
    })
}

/// A typed error unless a piece of shape `got` fits the output buffer's `want`.
fn fits(op: &'static str, got: &[usize], want: &[usize]) -> Result<()> {
    if got == want {
        Ok(())
    } else {
        Err(kernel_err(
            op,
            format!("piece {got:?} does not fit the output buffer {want:?}"),
        ))
    }
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
        Some(bad) => Err(kernel_err(op, format!("index {bad} out of range 0..{num}"))),
        None => Ok(()),
    }
}
