//! The device seam: `Device`, the `DeviceStorage`/`DeviceBackend` traits a non-CPU backend
//! (CUDA, in `cuda/`) implements, and the process-wide backend registry.
//!
//! # Contract for a device backend (CUDA)
//!
//! A backend provides two things:
//! 1. A storage type implementing [`DeviceStorage`]: one contiguous, row-major local piece on one
//!    device ordinal, with a fixed dtype and local shape. It is immutable once built (tensors are
//!    shared through `Arc`), must be `Send + Sync`, and can copy itself to the host
//!    (`to_host`, a `CpuArray` of the same dtype and shape). `comm_buf` exposes the device
//!    memory for collectives (`Buf::Device`) when the backend's communicator can use it.
//! 2. A [`DeviceBackend`] registered once per process with [`register_device_backend`]. It uploads
//!    host arrays (`from_host`) and runs local kernels (`run`): `op` is the op *with local
//!    attributes* (e.g. a reshape's local target shape, a mean's global divisor), `inputs` are the
//!    local pieces (all on this backend's device; the dispatcher never mixes devices; their count
//!    already checked against the op's arity), `outs` the shape and dtype of each output. A
//!    backend runs an op through the one executor, `Op::execute`, on its implementation of every
//!    op family's kernel trait (`op::Backend`), so it cannot lack a kernel, and its allocator
//!    (`KernelBackend::alloc`) makes every output buffer before the kernels write them.
//!
//! The dispatcher does everything else (shape/dtype/SBP checks, signature inference, boxing, output
//! layout) identically for every device. Boxing goes first to each registered backend's
//! `run_boxing` (the CUDA backend claims NCCL worlds and boxes device buffers there); otherwise
//! the dispatcher boxes on the host (`cpu::CpuPiece`), moving device pieces through the host.
//!
//! The CUDA backend (`cuda/`) implements both traits and registers itself from `init_cuda_on`.

use std::any::Any;
use std::fmt;
use std::sync::{Arc, RwLock};

use oxiflow_boxing::Plan;
use oxiflow_collectives::DType;
use oxiflow_placement::DeviceType;
use oxiflow_sbp::{Region, Shape};
use smallvec::SmallVec;

use crate::context::Context;
use crate::creation::ElementInit;
use crate::op::{Op, OutSpec};
use crate::storage::{CpuArray, Storage};
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

/// One local piece in device memory (see the module docs for the contract).
pub trait DeviceStorage: Send + Sync + fmt::Debug {
    fn device(&self) -> Device;
    fn dtype(&self) -> DType;
    /// Local shape (row-major, contiguous).
    fn shape(&self) -> &Shape;
    /// Copies the piece to the host.
    fn to_host(&self) -> Result<CpuArray>;
    /// Downcasting hook for the backend's own kernels.
    fn as_any(&self) -> &dyn Any;
}

/// Kernels and transfers of one device type (see the module docs for the contract).
pub trait DeviceBackend: Send + Sync {
    /// Uploads a host array to device `ordinal`.
    #[allow(clippy::wrong_self_convention)]
    fn from_host(&self, array: &CpuArray, ordinal: usize) -> Result<Arc<dyn DeviceStorage>>;
    /// Whether `create` computes `init` for `dtype` on the device (the default: no, so
    /// creation ops compute on the host and upload).
    fn creates(&self, _init: ElementInit, _dtype: DType) -> bool {
        false
    }
    /// The elements of `region` of a tensor of `shape` (zeros with `zero`), element `i` of
    /// the tensor from `init` exactly as the host computes it, on device `ordinal`. Called only
    /// where `creates` is true.
    fn create(
        &self,
        init: ElementInit,
        dtype: DType,
        shape: &Shape,
        region: &Region,
        zero: bool,
        ordinal: usize,
    ) -> Result<Arc<dyn DeviceStorage>> {
        let _ = (init, shape, region, zero, ordinal);
        Err(TensorError::Device {
            op: "create",
            devices: "device".into(),
            shapes: String::new(),
            detail: format!("this backend does not create {dtype} values"),
        })
    }
    /// Runs the local kernels of `op` on `inputs` through `Op::execute` on the backend's
    /// kernels, returning one piece per output of `outs` (shape and dtype as given).
    fn run(&self, op: &Op, inputs: &[&Storage], outs: &[OutSpec])
        -> Result<SmallVec<[Storage; 1]>>;
    /// Runs the boxing `plan` on this rank's `piece` (None outside the source placement) when
    /// `ctx`'s world is this backend's (e.g. device buffers straight to NCCL), returning the
    /// new piece (None outside the target). None: not this backend's world, so the dispatcher
    /// boxes on the host. The default claims no world.
    fn run_boxing(
        &self,
        op: &'static str,
        plan: &Plan,
        ctx: &Context,
        piece: Option<&Storage>,
    ) -> Option<Result<Option<Storage>>> {
        let _ = (op, plan, ctx, piece);
        None
    }
}

static CUDA_BACKEND: RwLock<Option<Arc<dyn DeviceBackend>>> = RwLock::new(None);

/// Registers the backend of a device type (only `Cuda` can be registered; CPU is built in).
pub fn register_device_backend(device: DeviceType, backend: Arc<dyn DeviceBackend>) -> Result<()> {
    match device {
        DeviceType::Cuda => {
            if let Ok(mut g) = CUDA_BACKEND.write() {
                *g = Some(backend);
            }
            Ok(())
        }
        DeviceType::Cpu => Err(TensorError::Device {
            op: "register_device_backend",
            devices: "cpu".into(),
            shapes: String::new(),
            detail: "the CPU backend is built in".into(),
        }),
    }
}

/// Every registered device backend (the dispatcher offers each a boxing plan first).
pub(crate) fn registered_backends() -> impl Iterator<Item = Arc<dyn DeviceBackend>> {
    CUDA_BACKEND.read().ok().and_then(|g| g.clone()).into_iter()
}

/// The registered backend of `device`, or a typed error naming `op`.
pub(crate) fn backend_for(op: &'static str, device: Device) -> Result<Arc<dyn DeviceBackend>> {
    let found = match device {
        Device::Cpu => None,
        Device::Cuda(_) => CUDA_BACKEND.read().ok().and_then(|g| g.clone()),
    };
    found.ok_or_else(|| TensorError::Device {
        op,
        devices: device.to_string(),
        shapes: String::new(),
        detail: format!("no backend registered for {device}"),
    })
}
