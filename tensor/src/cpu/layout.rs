//! Layout CPU kernels: permute, reshape, concat and narrow (outputs are row-major contiguous).

use ndarray::{ArrayD, Axis, IxDyn, Slice};

use super::float_input;
use super::{checked, CpuBackend};
use crate::element::TensorElement;
use crate::op::{LayoutKernels, OutSpec};
use crate::storage::CpuArray;
use crate::{with_array, Result, TensorError};

fn permute_t<T: TensorElement>(a: &ArrayD<T>, perm: &[usize]) -> ArrayD<T> {
    a.view()
        .permuted_axes(IxDyn(perm))
        .as_standard_layout()
        .into_owned()
}

pub fn permute(a: &CpuArray, perm: &[usize]) -> CpuArray {
    with_array!(a, a => TensorElement::wrap(permute_t(a, perm)))
}

fn reshape_t<T: TensorElement>(a: &ArrayD<T>, shape: &[usize]) -> Option<ArrayD<T>> {
    a.as_standard_layout()
        .into_owned()
        .into_shape_with_order(IxDyn(shape))
        .ok()
}

/// Row-major reshape of the local piece to `shape` (same element count).
pub fn reshape(a: &CpuArray, shape: &[usize]) -> Result<CpuArray> {
    let out = with_array!(a, a => reshape_t(a, shape).map(TensorElement::wrap));
    out.ok_or_else(|| TensorError::Kernel {
        op: "reshape",
        detail: format!("cannot reshape local piece {:?} to {shape:?}", a.shape()),
    })
}

fn concat_t<T: TensorElement>(parts: &[&CpuArray], dim: usize) -> Option<ArrayD<T>> {
    let views: Option<Vec<_>> = parts.iter().map(|p| T::view(p).map(|a| a.view())).collect();
    ndarray::concatenate(Axis(dim), &views?).ok()
}

/// Concatenates along `dim`.
pub fn concat(parts: &[&CpuArray], dim: usize) -> Result<CpuArray> {
    let out = match parts.first() {
        Some(CpuArray::F32(_)) => concat_t::<f32>(parts, dim).map(CpuArray::F32),
        Some(CpuArray::F64(_)) => concat_t::<f64>(parts, dim).map(CpuArray::F64),
        Some(CpuArray::I64(_)) => concat_t::<i64>(parts, dim).map(CpuArray::I64),
        Some(x) => return Err(float_input("concat", x)),
        None => None,
    };
    out.ok_or_else(|| TensorError::Kernel {
        op: "concat",
        detail: format!(
            "local pieces {:?} do not concatenate along dim {dim}",
            parts.iter().map(|p| p.shape().to_vec()).collect::<Vec<_>>()
        ),
    })
}

/// Elements `start..start + len` of `dim`.
pub fn narrow(a: &CpuArray, dim: usize, start: usize, len: usize) -> Result<CpuArray> {
    if dim >= a.shape().len() || start + len > a.shape()[dim] {
        return Err(TensorError::Kernel {
            op: "narrow",
            detail: format!(
                "range {start}..{} out of local piece {:?} dim {dim}",
                start + len,
                a.shape()
            ),
        });
    }
    Ok(with_array!(a, x => {
        let v = x.slice_axis(Axis(dim), Slice::from(start..start + len));
        wrap(v.as_standard_layout().into_owned())
    }))
}

/// Wraps an owned array as storage (helper for the generic macro arms above).
fn wrap<T: TensorElement>(a: ArrayD<T>) -> CpuArray {
    T::wrap(a)
}

impl LayoutKernels for CpuBackend {
    fn permute(&self, x: &CpuArray, perm: &[usize], out: &OutSpec) -> Result<CpuArray> {
        checked("permute", permute(x, perm), out)
    }
    fn reshape(&self, x: &CpuArray, out: &OutSpec) -> Result<CpuArray> {
        checked("reshape", reshape(x, out.shape.dims())?, out)
    }
    fn concat(&self, parts: &[&CpuArray], dim: usize, out: &OutSpec) -> Result<CpuArray> {
        checked("concat", concat(parts, dim)?, out)
    }
    fn narrow(
        &self,
        x: &CpuArray,
        dim: usize,
        start: usize,
        len: usize,
        out: &OutSpec,
    ) -> Result<CpuArray> {
        checked("narrow", narrow(x, dim, start, len)?, out)
    }
}
