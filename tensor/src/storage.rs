//! Storage of one local piece: `CpuArray` (ndarray, row-major contiguous) or a device piece
//! (`DeviceStorage`, implemented by a device backend), and `Device`, where a piece lives.

use std::any::Any;
use std::fmt;
use std::sync::Arc;

use oxiflow_dtype::DType;
use oxiflow_placement::DeviceType;
use oxiflow_sbp::Shape;

pub use crate::element::CpuArray;
use crate::{Result, TensorError};

/// Where a local piece lives: the host, or a CUDA device by ordinal.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, Default)]
pub enum Device {
    #[default]
    Cpu,
    Cuda(usize),
}

impl Device {
    pub fn device_type(self) -> DeviceType {
        match self {
            Device::Cpu => DeviceType::Cpu,
            Device::Cuda(_) => DeviceType::Cuda,
        }
    }
}

impl fmt::Display for Device {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            Device::Cpu => f.write_str("cpu"),
            Device::Cuda(i) => write!(f, "cuda:{i}"),
        }
    }
}

/// One local piece in device memory (see `device` for the backend contract).
pub trait DeviceStorage: Send + Sync + fmt::Debug {
    fn device(&self) -> Device;
    fn dtype(&self) -> DType;
    /// Local shape (row-major, contiguous).
    fn shape(&self) -> &Shape;
    /// Copies the piece to the host.
    fn to_host(&self) -> Result<CpuArray>;
    /// Starts copying the piece to the host behind the work queued on its device so far: the
    /// read's `wait` waits for that work and the copy only, not for work queued after this
    /// call. The default copies now (a backend without a queue has nothing to overlap).
    fn start_host_read(&self) -> Result<Box<dyn HostRead>> {
        Ok(Box::new(ReadDone(self.to_host()?)))
    }
    /// Downcasting hook for the backend's own kernels.
    fn as_any(&self) -> &dyn Any;
    /// Whether no other piece shares this one's memory (a view of part of it, say).
    /// The default, false, keeps every piece from being written in place.
    fn memory_is_its_own(&self) -> bool {
        false
    }
    /// Makes the device's compute stream wait for the collectives that wrote or read this
    /// piece's memory and that it has not waited for yet, so that work queued there next (a
    /// graph launched next, say) comes after them. The default does nothing: a backend without
    /// such collectives has nothing to wait for.
    fn order_after_collectives(&self) {}
    /// Whether collectives touched this piece's memory that the compute stream has not waited
    /// for yet (a parameter's all-gather still queued, say). The default, false: a backend
    /// without such collectives.
    fn awaits_collectives(&self) -> bool {
        false
    }
}

/// A copy of a piece to the host that may still be under way
/// ([`DeviceStorage::start_host_read`]).
pub trait HostRead: Send {
    /// The piece's elements, once the device work before the read and the copy are done.
    fn wait(self: Box<Self>) -> Result<CpuArray>;
}

/// A read that finished when it started.
pub struct ReadDone(pub CpuArray);

impl HostRead for ReadDone {
    fn wait(self: Box<Self>) -> Result<CpuArray> {
        Ok(self.0)
    }
}

/// The storage of a local piece.
#[derive(Clone, Debug)]
pub enum Storage {
    Cpu(CpuArray),
    /// A piece on a non-CPU device, implemented by that device's backend (see `device`).
    Device(Arc<dyn DeviceStorage>),
}

impl Storage {
    pub fn device(&self) -> Device {
        match self {
            Storage::Cpu(_) => Device::Cpu,
            Storage::Device(d) => d.device(),
        }
    }
    pub fn dtype(&self) -> DType {
        match self {
            Storage::Cpu(a) => a.dtype(),
            Storage::Device(d) => d.dtype(),
        }
    }
    /// The local shape.
    pub fn shape(&self) -> Shape {
        match self {
            Storage::Cpu(a) => Shape::from(a.shape()),
            Storage::Device(d) => d.shape().clone(),
        }
    }
    /// Bytes of the piece's elements.
    pub fn bytes(&self) -> usize {
        self.shape().numel() * self.dtype().size()
    }
    /// The host array (a copy for device storage).
    pub fn to_host(&self) -> Result<CpuArray> {
        match self {
            Storage::Cpu(a) => Ok(a.clone()),
            Storage::Device(d) => d.to_host(),
        }
    }
    /// The host array by reference; device storage is an error naming `op`.
    pub fn cpu(&self, op: &'static str) -> Result<&CpuArray> {
        match self {
            Storage::Cpu(a) => Ok(a),
            Storage::Device(d) => Err(TensorError::Device {
                op,
                devices: d.device().to_string(),
                shapes: d.shape().to_string(),
                detail: "expected host storage".into(),
            }),
        }
    }
}
