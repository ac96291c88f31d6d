//! Pieces as bytes: host arrays to little-endian bytes and back, safetensors dtypes, the
//! finiteness of saved values, and the copy of a region intersection from a saved piece into a
//! piece being loaded.

use std::ops::Range;

use ndarray::{ArrayD, IxDyn};
use oxiflow_dtype::{with_element, DType, Element};
use safetensors::Dtype;

use oxiflow_tensor::{with_array, CpuArray, TensorElement};

/// The safetensors dtype of `d`, by the name the dtype table gives it.
pub(crate) fn st_dtype(d: DType) -> Option<Dtype> {
    serde_json::from_value(serde_json::Value::from(d.safetensors_name())).ok()
}

/// The first element of little-endian `bytes` of `dtype` that is not finite (NaN or
/// infinite), as (index, value); None when every element is finite or the dtype is an integer.
pub(crate) fn first_non_finite(dtype: DType, bytes: &[u8]) -> Option<(usize, f64)> {
    if !dtype.is_float() {
        return None;
    }
    with_element!(dtype, T => bytes
        .chunks_exact(dtype.size())
        .map(|c| bytemuck::pod_read_unaligned::<T>(c).to_f64())
        .enumerate()
        .find(|(_, v)| !v.is_finite()))
}

/// Row-major little-endian bytes of a standard-layout array.
pub(crate) fn to_bytes(a: &CpuArray) -> Vec<u8> {
    with_array!(a, x => match x.as_slice() {
        Some(s) => bytemuck::cast_slice(s).to_vec(),
        None => x.iter().flat_map(|v| bytemuck::bytes_of(v).to_vec()).collect(),
    })
}

const _: () = assert!(
    cfg!(target_endian = "little"),
    "checkpoints assume a little-endian host"
);

/// A host array of `dtype` and `shape` from little-endian bytes (length already checked).
pub(crate) fn from_bytes(dtype: DType, shape: &[usize], bytes: &[u8]) -> Option<CpuArray> {
    with_element!(dtype, T => {
        let v: Vec<T> = bytes
            .chunks_exact(dtype.size())
            .map(bytemuck::pod_read_unaligned)
            .collect();
        ArrayD::from_shape_vec(IxDyn(shape), v).ok().map(TensorElement::wrap)
    })
}

/// The intersection of two regions (None when empty).
pub(crate) fn intersect(a: &[Range<usize>], b: &[Range<usize>]) -> Option<Vec<Range<usize>>> {
    if a.len() != b.len() {
        return None;
    }
    let r: Vec<Range<usize>> = a
        .iter()
        .zip(b)
        .map(|(x, y)| x.start.max(y.start)..x.end.min(y.end))
        .collect();
    r.iter().all(|x| x.start < x.end).then_some(r)
}

fn strides(region: &[Range<usize>]) -> Vec<usize> {
    let mut s = vec![1usize; region.len()];
    for d in (0..region.len().saturating_sub(1)).rev() {
        s[d] = s[d + 1] * region[d + 1].len();
    }
    s
}

/// Copies the elements of `inter` from `src` (bytes of region `src_region`) into `dst` (bytes
/// of region `dst_region`), `es` bytes per element, one contiguous run per last-dim row.
pub(crate) fn copy_region(
    src: &[u8],
    src_region: &[Range<usize>],
    dst: &mut [u8],
    dst_region: &[Range<usize>],
    inter: &[Range<usize>],
    es: usize,
) {
    let nd = inter.len();
    if nd == 0 {
        let n = es.min(src.len()).min(dst.len());
        dst[..n].copy_from_slice(&src[..n]);
        return;
    }
    let (ss, ds) = (strides(src_region), strides(dst_region));
    let run = inter[nd - 1].len();
    let outer: Vec<usize> = inter[..nd - 1].iter().map(|r| r.len()).collect();
    let rows: usize = outer.iter().product();
    let mut idx = vec![0usize; nd - 1];
    for _ in 0..rows {
        let (mut so, mut dof) = (0usize, 0usize);
        for d in 0..nd {
            let g = if d < nd - 1 {
                inter[d].start + idx[d]
            } else {
                inter[d].start
            };
            so += (g - src_region[d].start) * ss[d];
            dof += (g - dst_region[d].start) * ds[d];
        }
        let (a, b) = (so * es, dof * es);
        let n = run * es;
        if a + n <= src.len() && b + n <= dst.len() {
            dst[b..b + n].copy_from_slice(&src[a..a + n]);
        }
        for d in (0..nd - 1).rev() {
            idx[d] += 1;
            if idx[d] < outer[d] {
                break;
            }
            idx[d] = 0;
        }
    }
}
