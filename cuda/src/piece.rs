//! `CudaPiece`: the boxing executor's `LocalPiece` for CUDA placements. A piece lives on the
//! host (before a host -> CUDA device copy, after CUDA -> host) or in a device block; device
//! pieces pack, unpack and reduce through the strided-copy kernel and hand collectives
//! `BufMut::Device` views, so global tensors on cuda placements box through NCCL directly.

use std::ops::Range;
use std::sync::Arc;

use oxiflow_boxing::region::{fits, numel};
use oxiflow_boxing::{with_host_vec, BoxingError, Fill, HostData, HostPiece, LocalPiece};
use oxiflow_collectives::{Buf, BufMut, DevicePtr, ReduceOp};
use oxiflow_dtype::{with_element, DType};
use oxiflow_placement::DeviceType;
use oxiflow_sbp::Shape;

use super::copy::{cast, copy_nd, fill};
use super::kernels::strides;
use super::storage::{download, upload, CudaStorage};
use super::{runtime, Block, CudaRuntime};

/// A local piece on the host or on this process's CUDA device.
#[derive(Debug)]
pub enum CudaPiece {
    Host(HostPiece),
    Device(CudaStorage),
}

fn lerr(op: &str, e: impl std::fmt::Display) -> BoxingError {
    BoxingError::Local {
        op: op.into(),
        detail: e.to_string(),
    }
}

/// `op` between a host piece and a device piece.
fn mixed_devices(op: &str) -> BoxingError {
    lerr(op, "source and destination are on different devices")
}

fn rt(op: &'static str) -> Result<Arc<CudaRuntime>, BoxingError> {
    runtime(op).map_err(|e| lerr(op, e))
}

fn reduce_code(op: Option<ReduceOp>) -> i32 {
    match op {
        None => 0,
        Some(ReduceOp::Sum) => 1,
        Some(ReduceOp::Max) => 2,
        Some(ReduceOp::Min) => 3,
    }
}

impl CudaPiece {
    /// A device piece of `shape` whose elements the caller writes.
    fn alloc_device(shape: &Shape, dtype: DType) -> Result<CudaPiece, BoxingError> {
        let r = rt("CudaPiece::alloc")?;
        let block = Block::alloc(&r, shape.numel() * dtype.size())
            .map_err(|e| lerr("CudaPiece::alloc", e))?;
        Ok(CudaPiece::Device(CudaStorage::whole(
            Arc::new(block),
            dtype,
            shape.clone(),
        )))
    }

    /// A piece over a tensor's device storage, sharing its block: the executor never writes
    /// into it (`is_shared`; an all-reduce then goes out of place).
    pub fn from_storage(s: &CudaStorage) -> CudaPiece {
        CudaPiece::Device(s.clone())
    }

    /// The device storage of a device piece (None for a host piece).
    pub fn into_storage(self) -> Result<CudaStorage, CudaPiece> {
        match self {
            CudaPiece::Device(s) => Ok(s),
            h => Err(h),
        }
    }

    fn ptr(&self) -> u64 {
        match self {
            CudaPiece::Device(s) => s.ptr(),
            CudaPiece::Host(_) => 0,
        }
    }

    fn check(
        &self,
        other: &CudaPiece,
        regions: &[&[Range<usize>]],
        flat_off: usize,
        op: &str,
    ) -> Result<(), BoxingError> {
        if self.dtype() != other.dtype() {
            return Err(lerr(
                op,
                format!("dtype {} vs {}", self.dtype(), other.dtype()),
            ));
        }
        let mut total = 0usize;
        for r in regions {
            if !fits(self.shape(), r) {
                return Err(lerr(
                    op,
                    format!("box {r:?} lies outside a piece of shape {}", self.shape()),
                ));
            }
            total += numel(r);
        }
        if flat_off
            .checked_add(total)
            .is_none_or(|e| e > other.shape().numel())
        {
            return Err(lerr(
                op,
                format!(
                    "{total} elements at offset {flat_off} overrun a buffer of {} elements",
                    other.shape().numel()
                ),
            ));
        }
        Ok(())
    }

    /// Strided copies between each box of this piece and consecutive elements of `flat`,
    /// after `check`ing that they fit.
    fn boxes(
        &self,
        regions: &[&[Range<usize>]],
        flat: &CudaPiece,
        flat_off: usize,
        to_flat: bool,
        op: Option<ReduceOp>,
        name: &'static str,
    ) -> Result<(), BoxingError> {
        self.check(flat, regions, flat_off, name)?;
        let r = rt(name)?;
        let dt = self.dtype();
        let st = strides(self.shape().dims());
        // Equal boxes at evenly spaced offsets (the parts of an even split): one launch, with
        // the series as a leading dim.
        if let Some((bx, first, step)) = box_series(regions, &st) {
            let mut shape = vec![regions.len()];
            shape.extend(&bx);
            let mut pst = vec![step];
            pst.extend(&st);
            let mut fst = vec![bx.iter().product::<usize>() as i64];
            fst.extend(strides(&bx));
            let (src, dst) = if to_flat {
                ((self.ptr(), first, &pst), (flat.ptr(), flat_off, &fst))
            } else {
                ((flat.ptr(), flat_off, &fst), (self.ptr(), first, &pst))
            };
            let code = if to_flat { 0 } else { reduce_code(op) };
            return copy_nd(
                &r, name, dt, &shape, src.0, src.1, src.2, dst.0, dst.1, dst.2, code,
            )
            .map_err(|e| lerr(name, e));
        }
        let mut at = flat_off;
        for reg in regions {
            let bx: Vec<usize> = reg.iter().map(|x| x.len()).collect();
            let off = box_offset(reg, &st) as usize;
            let cst = strides(&bx);
            let res = if to_flat {
                copy_nd(
                    &r,
                    name,
                    dt,
                    &bx,
                    self.ptr(),
                    off,
                    &st,
                    flat.ptr(),
                    at,
                    &cst,
                    0,
                )
            } else {
                copy_nd(
                    &r,
                    name,
                    dt,
                    &bx,
                    flat.ptr(),
                    at,
                    &cst,
                    self.ptr(),
                    off,
                    &st,
                    reduce_code(op),
                )
            };
            res.map_err(|e| lerr(name, e))?;
            at += bx.iter().product::<usize>();
        }
        Ok(())
    }
}

/// The flat offset of a box's first element in a row-major piece of `strides`.
fn box_offset(reg: &[Range<usize>], strides: &[i64]) -> i64 {
    reg.iter()
        .zip(strides)
        .map(|(x, &s)| x.start as i64 * s)
        .sum()
}

/// When `regions` (two or more) are boxes of one shape whose offsets in a piece of `strides`
/// step evenly: (box extents, first offset, step).
fn box_series(regions: &[&[Range<usize>]], strides: &[i64]) -> Option<(Vec<usize>, usize, i64)> {
    let [first, second, ..] = regions else {
        return None;
    };
    let bx: Vec<usize> = first.iter().map(|x| x.len()).collect();
    let start = box_offset(first, strides);
    let step = box_offset(second, strides) - start;
    let series = regions.iter().enumerate().all(|(i, reg)| {
        reg.iter().map(|x| x.len()).eq(bx.iter().copied())
            && box_offset(reg, strides) == start + i as i64 * step
    });
    series.then_some((bx, start as usize, step))
}

/// The device bytes of `s` for a collective, fenced by its block: a collective on them leaves
/// its end event on the block (no compute-stream wait).
fn fenced_span(s: &CudaStorage) -> DevicePtr<'_> {
    // SAFETY: the block outlives the borrow and holds the view's numel * size bytes from its
    // offset.
    unsafe { DevicePtr::new(s.ptr(), s.bytes(), s.block.runtime().ordinal()) }.with_fence(&*s.block)
}

fn host_data_upload(r: &CudaRuntime, ptr: u64, d: &HostData) -> Result<(), BoxingError> {
    let op = "boxing to cuda";
    with_host_vec!(d, v => upload(r, ptr, v, op)).map_err(|e| lerr(op, e))
}

impl LocalPiece for CudaPiece {
    fn dtype(&self) -> DType {
        match self {
            CudaPiece::Host(h) => h.dtype(),
            CudaPiece::Device(s) => s.dtype,
        }
    }
    fn shape(&self) -> &Shape {
        match self {
            CudaPiece::Host(h) => &h.shape,
            CudaPiece::Device(s) => &s.shape,
        }
    }
    fn device(&self) -> DeviceType {
        match self {
            CudaPiece::Host(_) => DeviceType::Cpu,
            CudaPiece::Device(_) => DeviceType::Cuda,
        }
    }
    fn supports_device(_device: DeviceType) -> bool {
        true
    }
    fn is_shared(&self) -> bool {
        match self {
            CudaPiece::Host(_) => false,
            // Blocks the executor allocated have one owner; a tensor's block has two or more.
            CudaPiece::Device(s) => Arc::strong_count(&s.block) > 1,
        }
    }
    fn filled(
        shape: &Shape,
        dtype: DType,
        device: DeviceType,
        f: Fill,
    ) -> Result<Self, BoxingError> {
        if device == DeviceType::Cpu {
            return HostPiece::filled(shape, dtype, device, f).map(CudaPiece::Host);
        }
        let p = Self::alloc_device(shape, dtype)?;
        let (v, vi) = match f {
            Fill::Zero | Fill::Identity(ReduceOp::Sum) => (0.0, 0),
            Fill::Identity(ReduceOp::Max) => (f64::NEG_INFINITY, i64::MIN),
            Fill::Identity(ReduceOp::Min) => (f64::INFINITY, i64::MAX),
        };
        let r = rt("CudaPiece::filled")?;
        fill(
            &r,
            "CudaPiece::filled",
            dtype,
            p.ptr(),
            shape.numel(),
            v,
            vi,
        )
        .map_err(|e| lerr("CudaPiece::filled", e))?;
        Ok(p)
    }
    fn alloc(shape: &Shape, dtype: DType, device: DeviceType) -> Result<Self, BoxingError> {
        if device == DeviceType::Cpu {
            return HostPiece::alloc(shape, dtype, device).map(CudaPiece::Host);
        }
        Self::alloc_device(shape, dtype)
    }
    fn reshape(self, shape: Shape) -> Result<Self, BoxingError> {
        match self {
            CudaPiece::Host(h) => h.reshape(shape).map(CudaPiece::Host),
            CudaPiece::Device(s) => {
                if shape.numel() != s.shape.numel() {
                    let old = &s.shape;
                    return Err(lerr("reshape", format!("cannot view {old} as {shape}")));
                }
                Ok(CudaPiece::Device(s.reshaped(shape)))
            }
        }
    }
    fn pack(
        &self,
        regions: &[&[Range<usize>]],
        dst: &mut Self,
        dst_offset: usize,
    ) -> Result<(), BoxingError> {
        match (self, &mut *dst) {
            (CudaPiece::Host(s), CudaPiece::Host(d)) => s.pack(regions, d, dst_offset),
            (CudaPiece::Device(_), CudaPiece::Device(_)) => {
                self.boxes(regions, dst, dst_offset, true, None, "pack")
            }
            _ => Err(mixed_devices("pack")),
        }
    }
    fn unpack(
        &mut self,
        regions: &[&[Range<usize>]],
        src: &Self,
        src_offset: usize,
        op: Option<ReduceOp>,
    ) -> Result<(), BoxingError> {
        match (&mut *self, src) {
            (CudaPiece::Host(d), CudaPiece::Host(s)) => d.unpack(regions, s, src_offset, op),
            (CudaPiece::Device(_), CudaPiece::Device(_)) => {
                self.boxes(regions, src, src_offset, false, op, "unpack")
            }
            _ => Err(mixed_devices("unpack")),
        }
    }
    fn to_dtype(&self, to: DType) -> Result<Self, BoxingError> {
        match self {
            CudaPiece::Host(h) => h.to_dtype(to).map(CudaPiece::Host),
            CudaPiece::Device(s) => {
                let op = "boxing cast";
                let r = rt(op)?;
                let n = s.shape.numel();
                let out = Block::alloc(&r, n.max(1) * to.size()).map_err(|e| lerr(op, e))?;
                cast(&r, op, (s.dtype, s.ptr()), (to, out.ptr()), n).map_err(|e| lerr(op, e))?;
                Ok(CudaPiece::Device(CudaStorage::whole(
                    Arc::new(out),
                    to,
                    s.shape.clone(),
                )))
            }
        }
    }
    fn to_device(self, device: DeviceType) -> Result<Self, BoxingError> {
        match (self, device) {
            (p @ CudaPiece::Host(_), DeviceType::Cpu)
            | (p @ CudaPiece::Device(_), DeviceType::Cuda) => Ok(p),
            (CudaPiece::Host(h), DeviceType::Cuda) => {
                let p = Self::alloc_device(&h.shape, h.dtype())?;
                let r = rt("boxing to cuda")?;
                host_data_upload(&r, p.ptr(), &h.data)?;
                Ok(p)
            }
            (CudaPiece::Device(s), DeviceType::Cpu) => {
                let op = "boxing to host";
                let r = rt(op)?;
                let n = s.shape.numel();
                let data = with_element!(s.dtype, T => {
                    let mut v = vec![T::default(); n];
                    download(&r, s.ptr(), &mut v, op).map(|_| HostData::from(v))
                })
                .map_err(|e| lerr(op, e))?;
                Ok(CudaPiece::Host(HostPiece {
                    shape: s.shape,
                    data,
                }))
            }
        }
    }
    fn as_buf(&self) -> Buf<'_> {
        match self {
            CudaPiece::Host(h) => h.as_buf(),
            CudaPiece::Device(s) => Buf::Device(fenced_span(s)),
        }
    }
    fn as_buf_mut(&mut self) -> BufMut<'_> {
        match self {
            CudaPiece::Host(h) => h.as_buf_mut(),
            // The executor writes only pieces it owns (see from_storage).
            CudaPiece::Device(s) => BufMut::Device(fenced_span(s)),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn even_column_parts_are_one_series() {
        // [6, 12] split into 3 column parts of 4: offsets 0, 4, 8.
        let st = strides(&[6, 12]);
        let parts = [[0..6, 0..4], [0..6, 4..8], [0..6, 8..12]];
        let refs: Vec<&[Range<usize>]> = parts.iter().map(|p| p.as_slice()).collect();
        assert_eq!(box_series(&refs, &st), Some((vec![6, 4], 0, 4)));
    }

    #[test]
    fn uneven_or_irregular_boxes_are_not() {
        let st = strides(&[6, 10]);
        // Uneven split 4/3/3.
        let parts = [[0..6, 0..4], [0..6, 4..7], [0..6, 7..10]];
        let refs: Vec<&[Range<usize>]> = parts.iter().map(|p| p.as_slice()).collect();
        assert_eq!(box_series(&refs, &st), None);
        // Equal boxes, uneven spacing.
        let parts = [[0..2, 0..2], [0..2, 3..5], [0..2, 5..7]];
        let refs: Vec<&[Range<usize>]> = parts.iter().map(|p| p.as_slice()).collect();
        assert_eq!(box_series(&refs, &st), None);
        // A single box is left to the plain path.
        let refs: Vec<&[Range<usize>]> = vec![&parts[0]];
        assert_eq!(box_series(&refs, &st), None);
        // Row parts of a [6, 10] piece: offsets 0, 20, 40.
        let parts = [[0..2, 0..10], [2..4, 0..10], [4..6, 0..10]];
        let refs: Vec<&[Range<usize>]> = parts.iter().map(|p| p.as_slice()).collect();
        assert_eq!(box_series(&refs, &st), Some((vec![2, 10], 0, 20)));
    }
}
