//! `CpuPiece`: host storage as a boxing `LocalPiece`. A tensor's immutable CPU storage boxes
//! in place (shared, read straight from the ndarray memory, never written); pieces the
//! executor makes are owned `HostPiece`s, which become `CpuArray`s without a copy. Also the
//! one conversion between `Storage` and `HostPiece` (used where a `HostPiece` is needed, e.g.
//! host pieces inside the CUDA boxing path).

use std::ops::Range;
use std::sync::Arc;

use ndarray::{ArrayD, IxDyn};
use oxiflow_boxing::with_host_vec;
use oxiflow_boxing::{
    check_same_dtype, copy_box_bytes, pack_bytes, unpack_bytes, BoxingError, Fill, HostBytes,
    HostData, HostPiece, LocalPiece,
};
use oxiflow_collectives::{Buf, BufMut, ReduceOp};
use oxiflow_dtype::DType;
use oxiflow_placement::DeviceType;
use oxiflow_sbp::Shape;

use crate::element::TensorElement;
use crate::storage::{CpuArray, Storage};
use crate::with_array;
use crate::{Result, TensorError};

/// A local piece in host memory for the boxing executor.
#[derive(Debug)]
pub(crate) enum CpuPiece {
    /// A tensor's CPU storage (standard layout, checked at construction), viewed as `shape`
    /// (a reshape changes only this). Read only: `is_shared` is true.
    Shared { storage: Arc<Storage>, shape: Shape },
    /// Memory the executor owns.
    Owned(HostPiece),
}

/// The bytes of a CPU storage in standard layout, or None (device storage, other layouts).
fn storage_bytes(storage: &Storage) -> Option<&[u8]> {
    match storage {
        Storage::Cpu(a) => with_array!(a, a => a.as_slice().map(bytemuck::cast_slice)),
        Storage::Device(_) => None,
    }
}

/// A copy of a storage as a host piece (device storage comes through the host).
pub fn host_piece_of(storage: &Storage) -> Result<HostPiece> {
    let host = storage.to_host()?.into_standard();
    let shape = Shape::from(host.shape());
    let data = with_array!(host, a => HostData::from(a.into_raw_vec_and_offset().0));
    Ok(HostPiece { shape, data })
}

/// A host piece as a `CpuArray` (moves the vector; no copy).
pub fn array_of_host_piece(piece: HostPiece) -> Result<CpuArray> {
    let dims = IxDyn(piece.shape.dims());
    let bad = |e: ndarray::ShapeError| TensorError::Kernel {
        op: "boxing",
        detail: format!("host piece of shape {}: {e}", piece.shape),
    };
    Ok(with_host_vec!(piece.data, v => {
        TensorElement::wrap(ArrayD::from_shape_vec(dims, v).map_err(bad)?)
    }))
}

/// An owned copy of a shared storage, viewed as `shape`.
fn owned_copy(storage: &Storage, shape: &Shape) -> std::result::Result<HostPiece, BoxingError> {
    let piece = host_piece_of(storage).map_err(|e| BoxingError::Local {
        op: "CpuPiece::owned_copy".into(),
        detail: e.to_string(),
    })?;
    piece.reshape(shape.clone())
}

impl CpuPiece {
    /// A piece over a tensor's storage: shared when it is CPU storage in standard layout,
    /// otherwise an owned host copy.
    pub(crate) fn from_storage(storage: &Arc<Storage>) -> Result<CpuPiece> {
        if storage_bytes(storage).is_some() {
            return Ok(CpuPiece::Shared {
                shape: storage.shape(),
                storage: storage.clone(),
            });
        }
        host_piece_of(storage).map(CpuPiece::Owned)
    }

    /// The piece as a storage: the shared input itself when it kept its shape (no copy), an
    /// owned piece's vector moved into an array (no copy).
    pub(crate) fn into_storage(self) -> Result<Arc<Storage>> {
        match self {
            CpuPiece::Shared { storage, shape } if storage.shape() == shape => Ok(storage),
            CpuPiece::Shared { storage, shape } => {
                let piece = owned_copy(&storage, &shape).map_err(|e| TensorError::Kernel {
                    op: "boxing",
                    detail: e.to_string(),
                })?;
                Ok(Arc::new(Storage::Cpu(array_of_host_piece(piece)?)))
            }
            CpuPiece::Owned(p) => Ok(Arc::new(Storage::Cpu(array_of_host_piece(p)?))),
        }
    }

    /// The piece as bytes for the byte-level copies.
    fn host_bytes(&self) -> HostBytes<'_> {
        match self {
            CpuPiece::Shared { storage, shape } => HostBytes {
                shape,
                dtype: storage.dtype(),
                // Construction checked that the storage has host bytes; an empty slice here
                // would fail the byte-level length checks, never read out of bounds.
                bytes: storage_bytes(storage).unwrap_or(&[]),
            },
            CpuPiece::Owned(p) => p.host_bytes(),
        }
    }

    /// The owned piece, copying a shared one first (a write never reaches a tensor's storage).
    fn owned_mut(&mut self) -> std::result::Result<&mut HostPiece, BoxingError> {
        if let CpuPiece::Shared { storage, shape } = self {
            *self = CpuPiece::Owned(owned_copy(storage, shape)?);
        }
        match self {
            CpuPiece::Owned(p) => Ok(p),
            CpuPiece::Shared { shape, .. } => Err(BoxingError::Local {
                op: "CpuPiece::owned_mut".into(),
                detail: format!("a shared piece of shape {shape} stayed shared"),
            }),
        }
    }
}

impl LocalPiece for CpuPiece {
    fn dtype(&self) -> DType {
        self.host_bytes().dtype
    }
    fn shape(&self) -> &Shape {
        match self {
            CpuPiece::Shared { shape, .. } => shape,
            CpuPiece::Owned(p) => &p.shape,
        }
    }
    fn device(&self) -> DeviceType {
        DeviceType::Cpu
    }
    fn supports_device(device: DeviceType) -> bool {
        HostPiece::supports_device(device)
    }
    fn filled(
        shape: &Shape,
        dtype: DType,
        device: DeviceType,
        fill: Fill,
    ) -> std::result::Result<Self, BoxingError> {
        HostPiece::filled(shape, dtype, device, fill).map(CpuPiece::Owned)
    }
    fn scratch(
        len: usize,
        dtype: DType,
        device: DeviceType,
    ) -> std::result::Result<Self, BoxingError> {
        HostPiece::scratch(len, dtype, device).map(CpuPiece::Owned)
    }
    fn recycle(self) {
        if let CpuPiece::Owned(p) = self {
            p.recycle();
        }
    }
    fn is_shared(&self) -> bool {
        matches!(self, CpuPiece::Shared { .. })
    }
    fn reshape(self, new_shape: Shape) -> std::result::Result<Self, BoxingError> {
        match self {
            CpuPiece::Shared { storage, shape } => {
                if new_shape.numel() != shape.numel() {
                    return Err(BoxingError::Local {
                        op: "reshape".into(),
                        detail: format!("cannot view a piece of shape {shape} as {new_shape}"),
                    });
                }
                Ok(CpuPiece::Shared {
                    storage,
                    shape: new_shape,
                })
            }
            CpuPiece::Owned(p) => p.reshape(new_shape).map(CpuPiece::Owned),
        }
    }
    fn pack(
        &self,
        regions: &[&[Range<usize>]],
        dst: &mut Self,
        dst_offset: usize,
    ) -> std::result::Result<(), BoxingError> {
        check_same_dtype("pack", self.dtype(), dst.dtype())?;
        let out = dst.owned_mut()?;
        pack_bytes(self.host_bytes(), regions, out.data.bytes_mut(), dst_offset)
    }
    fn unpack(
        &mut self,
        regions: &[&[Range<usize>]],
        src: &Self,
        src_offset: usize,
        op: Option<ReduceOp>,
    ) -> std::result::Result<(), BoxingError> {
        check_same_dtype("unpack", self.dtype(), src.dtype())?;
        let out = self.owned_mut()?;
        let dtype = out.data.dtype();
        unpack_bytes(
            &out.shape,
            dtype,
            out.data.bytes_mut(),
            regions,
            src.host_bytes().bytes,
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
    ) -> std::result::Result<(), BoxingError> {
        check_same_dtype("copy_box", self.dtype(), src.dtype())?;
        let out = self.owned_mut()?;
        copy_box_bytes(
            &out.shape,
            out.data.bytes_mut(),
            at,
            src.host_bytes(),
            src_box,
            op,
        )
    }
    fn to_device(self, device: DeviceType) -> std::result::Result<Self, BoxingError> {
        if device == DeviceType::Cpu {
            Ok(self)
        } else {
            Err(BoxingError::UnsupportedDevice {
                op: "CpuPiece::to_device".into(),
                device: device.to_string(),
            })
        }
    }
    fn to_dtype(&self, dtype: DType) -> std::result::Result<Self, BoxingError> {
        match self {
            CpuPiece::Owned(p) => p.to_dtype(dtype).map(CpuPiece::Owned),
            CpuPiece::Shared { storage, shape } => owned_copy(storage, shape)?
                .to_dtype(dtype)
                .map(CpuPiece::Owned),
        }
    }
    fn as_buf(&self) -> Buf<'_> {
        Buf::Host(self.host_bytes().bytes)
    }
    fn as_buf_mut(&mut self) -> BufMut<'_> {
        match self.owned_mut() {
            Ok(p) => p.as_buf_mut(),
            // `owned_mut` always leaves an owned piece; an empty buffer fails the
            // communicator's length checks rather than writing anywhere.
            Err(_) => BufMut::Host(&mut []),
        }
    }
}
