//! The local-piece seam: `LocalPiece`, the few local operations the executor needs, and
//! `HostPiece`, its row-major host-memory implementation. A device piece implements the same
//! trait in the crate that owns device memory.

use std::ops::Range;

use oxiflow_collectives::{Buf, BufMut, ReduceOp};
use oxiflow_dtype::{bf16, convert, f16, with_element, DType, Element};
use oxiflow_placement::DeviceType;
use oxiflow_sbp::Shape;

use crate::piece_bytes::{check_same_dtype, copy_box_bytes, pack_bytes, unpack_bytes, HostBytes};
use crate::BoxingError;

/// How a freshly made piece is filled.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Fill {
    /// All zeros (also the sum identity).
    Zero,
    /// The identity of a reduction: 0 for sum, the lowest value for max, the highest for min.
    Identity(ReduceOp),
}

/// One rank's local piece of a global tensor: a dense row-major array of one dtype on one
/// device. The executor only ever uses these operations, so any memory (host, CUDA) can box.
pub trait LocalPiece: Sized + Send {
    fn dtype(&self) -> DType;
    fn shape(&self) -> &Shape;
    fn device(&self) -> DeviceType;
    /// Whether this piece type can live on `device` (checked before any communication).
    fn supports_device(device: DeviceType) -> bool;
    /// A new piece of `shape` on `device`, filled as asked.
    fn filled(
        shape: &Shape,
        dtype: DType,
        device: DeviceType,
        fill: Fill,
    ) -> Result<Self, BoxingError>;
    /// A new piece whose every element the caller overwrites (may skip the fill).
    fn alloc(shape: &Shape, dtype: DType, device: DeviceType) -> Result<Self, BoxingError> {
        Self::filled(shape, dtype, device, Fill::Zero)
    }
    /// A flat staging buffer of `len` elements whose every element the caller overwrites;
    /// implementations may hand out recycled memory (see `recycle`).
    fn scratch(len: usize, dtype: DType, device: DeviceType) -> Result<Self, BoxingError> {
        Self::alloc(&Shape::new([len]), dtype, device)
    }
    /// Returns a staging buffer from `scratch` for reuse (the default drops it).
    fn recycle(self) {}
    /// Whether the piece's memory is also someone else's (e.g. a tensor's immutable storage),
    /// so the executor must not write into it: an all-reduce then goes out of place. The
    /// default (pieces that own their memory) is false.
    fn is_shared(&self) -> bool {
        false
    }
    /// The same elements under another shape of equal element count.
    fn reshape(self, shape: Shape) -> Result<Self, BoxingError>;
    /// Copies the elements of each of `regions` (boxes in this piece's index space), one after
    /// another in row-major order, into `dst`'s flat storage starting at element `dst_offset`.
    fn pack(
        &self,
        regions: &[&[Range<usize>]],
        dst: &mut Self,
        dst_offset: usize,
    ) -> Result<(), BoxingError>;
    /// The inverse of `pack`: reads consecutive elements of `src` from `src_offset` into each of
    /// `regions` of this piece; with `op` they are reduced into the present values instead.
    fn unpack(
        &mut self,
        regions: &[&[Range<usize>]],
        src: &Self,
        src_offset: usize,
        op: Option<ReduceOp>,
    ) -> Result<(), BoxingError>;
    /// Copies the box `src_box` of `src` into the box `at` of this piece (equal extents),
    /// optionally reducing. The default goes through a temporary; implementations copy
    /// directly.
    fn copy_box(
        &mut self,
        at: &[Range<usize>],
        src: &Self,
        src_box: &[Range<usize>],
        op: Option<ReduceOp>,
    ) -> Result<(), BoxingError> {
        let part = src.slice(src_box)?;
        self.write_region(at, &part, op)
    }
    /// A copy of this piece on `device`.
    fn to_device(self, device: DeviceType) -> Result<Self, BoxingError>;
    /// A copy with every element converted to `dtype`, each value rounded once (the executor
    /// sums 16-bit partial values in f32 through it).
    fn to_dtype(&self, dtype: DType) -> Result<Self, BoxingError>;
    /// The storage as a communicator buffer.
    fn as_buf(&self) -> Buf<'_>;
    fn as_buf_mut(&mut self) -> BufMut<'_>;

    /// A new piece holding a copy of one box of this one.
    fn slice(&self, region: &[Range<usize>]) -> Result<Self, BoxingError> {
        let shape = crate::region::shape_of(region);
        let mut out = Self::alloc(&shape, self.dtype(), self.device())?;
        self.pack(&[region], &mut out, 0)?;
        Ok(out)
    }
    /// Writes all of `src` into the box `at` of this piece (optionally reducing).
    fn write_region(
        &mut self,
        at: &[Range<usize>],
        src: &Self,
        op: Option<ReduceOp>,
    ) -> Result<(), BoxingError> {
        self.unpack(&[at], src, 0, op)
    }
}

/// Declares `HostData` with one variant per dtype (named as the `DType` variant) and the
/// conversions between its variants, the dtypes and the element vectors.
macro_rules! host_data {
    ($($v:ident($t:ty)),* $(,)?) => {
        /// Host storage of a `HostPiece`, row-major and contiguous.
        #[derive(Clone, Debug, PartialEq)]
        pub enum HostData {
            $($v(Vec<$t>)),*
        }

        $(impl From<Vec<$t>> for HostData {
            fn from(v: Vec<$t>) -> HostData {
                HostData::$v(v)
            }
        })*

        impl HostData {
            pub fn dtype(&self) -> DType {
                match self {
                    $(HostData::$v(_) => DType::$v),*
                }
            }
            pub fn len(&self) -> usize {
                match self {
                    $(HostData::$v(v) => v.len()),*
                }
            }
            pub fn bytes(&self) -> &[u8] {
                match self {
                    $(HostData::$v(v) => bytemuck::cast_slice(v)),*
                }
            }
            pub fn bytes_mut(&mut self) -> &mut [u8] {
                match self {
                    $(HostData::$v(v) => bytemuck::cast_slice_mut(v)),*
                }
            }
            /// Keeps the first `len` elements.
            pub fn truncate(&mut self, len: usize) {
                match self {
                    $(HostData::$v(v) => v.truncate(len)),*
                }
            }
            /// Every element converted to `dtype` (each value rounded once; see
            /// `oxiflow_dtype::Element::from_f64`).
            pub fn to_dtype(&self, dtype: DType) -> HostData {
                match self {
                    $(HostData::$v(v) => with_element!(dtype, D => HostData::from(convert::<$t, D>(v)))),*
                }
            }
        }
    };
}

host_data!(F32(f32), F64(f64), I64(i64), BF16(bf16), F16(f16));

/// Applies `$body` to the vector inside a `HostData`, binding it as `$v` (generic over the
/// element type).
#[macro_export]
macro_rules! with_host_vec {
    ($d:expr, $v:ident => $body:expr) => {
        match $d {
            $crate::HostData::F32($v) => $body,
            $crate::HostData::F64($v) => $body,
            $crate::HostData::I64($v) => $body,
            $crate::HostData::BF16($v) => $body,
            $crate::HostData::F16($v) => $body,
        }
    };
}

impl HostData {
    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }
    /// `n` elements of `dtype`, filled as asked.
    pub fn filled(dtype: DType, n: usize, fill: Fill) -> HostData {
        with_element!(dtype, T => HostData::from(vec![
            match fill {
                Fill::Zero | Fill::Identity(ReduceOp::Sum) => T::zero(),
                Fill::Identity(ReduceOp::Max) => T::LOWEST,
                Fill::Identity(ReduceOp::Min) => T::HIGHEST,
            };
            n
        ]))
    }
}

/// A local piece in host memory.
#[derive(Clone, Debug, PartialEq)]
pub struct HostPiece {
    pub shape: Shape,
    pub data: HostData,
}

/// Staging buffers kept per thread for reuse, and the largest one kept: reused memory is
/// already mapped, so staging costs no page faults on the hot path.
const POOL_ENTRIES: usize = 4;
const POOL_MAX_BYTES: usize = 1 << 30;

thread_local! {
    static POOL: std::cell::RefCell<Vec<HostData>> = const { std::cell::RefCell::new(Vec::new()) };
}

impl HostPiece {
    /// A piece from data; errors when the element count does not match the shape.
    pub fn new(shape: impl Into<Shape>, data: HostData) -> Result<Self, BoxingError> {
        let shape = shape.into();
        if shape.numel() != data.len() {
            return Err(BoxingError::Local {
                op: "HostPiece::new".into(),
                detail: format!(
                    "shape {shape} needs {} elements, data has {}",
                    shape.numel(),
                    data.len()
                ),
            });
        }
        Ok(HostPiece { shape, data })
    }

    /// The piece as bytes for the byte-level copies.
    pub fn host_bytes(&self) -> HostBytes<'_> {
        HostBytes {
            shape: &self.shape,
            dtype: self.data.dtype(),
            bytes: self.data.bytes(),
        }
    }
}

impl LocalPiece for HostPiece {
    fn dtype(&self) -> DType {
        self.data.dtype()
    }
    fn shape(&self) -> &Shape {
        &self.shape
    }
    fn device(&self) -> DeviceType {
        DeviceType::Cpu
    }
    fn supports_device(device: DeviceType) -> bool {
        device == DeviceType::Cpu
    }
    fn filled(
        shape: &Shape,
        dtype: DType,
        device: DeviceType,
        fill: Fill,
    ) -> Result<Self, BoxingError> {
        if device != DeviceType::Cpu {
            return Err(BoxingError::UnsupportedDevice {
                op: "HostPiece::filled".into(),
                device: device.to_string(),
            });
        }
        let data = HostData::filled(dtype, shape.numel(), fill);
        Ok(HostPiece {
            shape: shape.clone(),
            data,
        })
    }
    fn scratch(len: usize, dtype: DType, device: DeviceType) -> Result<Self, BoxingError> {
        if device == DeviceType::Cpu {
            let reused = POOL.with(|p| {
                let mut pool = p.borrow_mut();
                // The smallest pooled buffer of this dtype that is long enough.
                let best = pool
                    .iter()
                    .enumerate()
                    .filter(|(_, d)| d.dtype() == dtype && d.len() >= len)
                    .min_by_key(|(_, d)| d.len())
                    .map(|(i, _)| i);
                best.map(|i| pool.swap_remove(i))
            });
            if let Some(mut data) = reused {
                data.truncate(len);
                return Ok(HostPiece {
                    shape: Shape::new([len]),
                    data,
                });
            }
        }
        Self::alloc(&Shape::new([len]), dtype, device)
    }
    fn recycle(self) {
        let bytes = self.data.len() * self.data.dtype().size();
        if bytes == 0 || bytes > POOL_MAX_BYTES {
            return;
        }
        POOL.with(|p| {
            let mut pool = p.borrow_mut();
            if pool.len() >= POOL_ENTRIES {
                // Keep the larger buffers.
                if let Some((i, _)) = pool.iter().enumerate().min_by_key(|(_, d)| d.len()) {
                    if pool[i].len() >= self.data.len() {
                        return;
                    }
                    pool.swap_remove(i);
                }
            }
            pool.push(self.data);
        });
    }
    fn reshape(mut self, shape: Shape) -> Result<Self, BoxingError> {
        if shape.numel() != self.data.len() {
            return Err(BoxingError::Local {
                op: "reshape".into(),
                detail: format!(
                    "cannot view {} elements of shape {} as {shape}",
                    self.data.len(),
                    self.shape
                ),
            });
        }
        self.shape = shape;
        Ok(self)
    }
    fn pack(
        &self,
        regions: &[&[Range<usize>]],
        dst: &mut Self,
        dst_offset: usize,
    ) -> Result<(), BoxingError> {
        check_same_dtype("pack", self.dtype(), dst.dtype())?;
        pack_bytes(self.host_bytes(), regions, dst.data.bytes_mut(), dst_offset)
    }
    fn unpack(
        &mut self,
        regions: &[&[Range<usize>]],
        src: &Self,
        src_offset: usize,
        op: Option<ReduceOp>,
    ) -> Result<(), BoxingError> {
        check_same_dtype("unpack", self.dtype(), src.dtype())?;
        let dtype = self.dtype();
        unpack_bytes(
            &self.shape,
            dtype,
            self.data.bytes_mut(),
            regions,
            src.data.bytes(),
            src_offset,
            op,
        )
    }
    fn copy_box(
        &mut self,
        at: &[Range<usize>],
        src: &Self,
        src_box: &[Range<usize>],
        op: Option<ReduceOp>,
    ) -> Result<(), BoxingError> {
        check_same_dtype("copy_box", self.dtype(), src.dtype())?;
        copy_box_bytes(
            &self.shape,
            self.data.bytes_mut(),
            at,
            src.host_bytes(),
            src_box,
            op,
        )
    }
    fn to_device(self, device: DeviceType) -> Result<Self, BoxingError> {
        if device == DeviceType::Cpu {
            Ok(self)
        } else {
            Err(BoxingError::UnsupportedDevice {
                op: "HostPiece::to_device".into(),
                device: device.to_string(),
            })
        }
    }
    fn to_dtype(&self, dtype: DType) -> Result<Self, BoxingError> {
        Ok(HostPiece {
            shape: self.shape.clone(),
            data: self.data.to_dtype(dtype),
        })
    }
    fn as_buf(&self) -> Buf<'_> {
        Buf::Host(self.data.bytes())
    }
    fn as_buf_mut(&mut self) -> BufMut<'_> {
        BufMut::Host(self.data.bytes_mut())
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use oxiflow_sbp::Region;

    #[test]
    fn pack_unpack_roundtrip() {
        let p = HostPiece::new([3, 4], HostData::F64((0..12).map(f64::from).collect())).unwrap();
        let r: Region = [1..3, 1..3].into_iter().collect();
        let s = p.slice(&r).unwrap();
        assert_eq!(s.data, HostData::F64(vec![5.0, 6.0, 9.0, 10.0]));
        let mut z = HostPiece::filled(
            &Shape::from([3, 4]),
            DType::F64,
            DeviceType::Cpu,
            Fill::Zero,
        )
        .unwrap();
        z.write_region(&r, &s, None).unwrap();
        z.write_region(&r, &s, Some(ReduceOp::Sum)).unwrap();
        let HostData::F64(v) = &z.data else { panic!() };
        assert_eq!(v[5], 10.0);
        assert_eq!(v[0], 0.0);
        let mut y = HostPiece::filled(
            &Shape::from([2, 2]),
            DType::F64,
            DeviceType::Cpu,
            Fill::Zero,
        )
        .unwrap();
        let all: Region = [0..2, 0..2].into_iter().collect();
        y.copy_box(&all, &p, &r, None).unwrap();
        assert_eq!(y, s);
        let bad: Region = [2..4, 0..1].into_iter().collect();
        assert!(p.slice(&bad).is_err());
    }
}
