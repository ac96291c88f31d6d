//! The device seam: `DeviceBackend`, what a non-CPU backend (CUDA: the `oxiflow-cuda` crate)
//! provides for its pieces (uploads, device-side creation, boxing in its own worlds), and the
//! process-wide backend registry. It knows pieces (`Storage`, `DeviceStorage`), boxing plans
//! and communicators, and nothing of ops, contexts or tensors: running ops is the executor seam
//! (`executor::OpExecutor`), which a backend registers beside this one.
//!
//! # Contract for a device backend (CUDA)
//!
//! A backend provides three things:
//! 1. A storage type implementing [`DeviceStorage`]: one contiguous, row-major local piece on one
//!    device ordinal, with a fixed dtype and local shape. It is immutable once built (tensors are
//!    shared through `Arc`), must be `Send + Sync`, and can copy itself to the host
//!    (`to_host`, a `CpuArray` of the same dtype and shape).
//! 2. A [`DeviceBackend`] registered once per process with [`register_device_backend`]: it
//!    uploads host arrays (`from_host`), may compute creation ops on the device (`create`), and
//!    runs boxing plans in the worlds it owns (`run_boxing`: the CUDA backend claims NCCL worlds
//!    and boxes device buffers there; otherwise the dispatcher boxes on the host, moving device
//!    pieces through it).
//! 3. An `OpExecutor` registered with `register_op_executor`: it runs an op (with local
//!    attributes) through the one executor, `Op::execute`, on its implementation of every op
//!    family's kernel trait (`op::Backend`), so it cannot lack a kernel, and its allocator
//!    (`KernelBackend::alloc`) makes every output buffer before the kernels write them.
//!
//! The dispatcher does everything else (shape/dtype/SBP checks, signature inference, boxing
//! plans, output layout) identically for every device.

use std::sync::Arc;

use oxiflow_boxing::Plan;
use oxiflow_collectives::SharedComm;
use oxiflow_dtype::DType;
use oxiflow_placement::DeviceType;
use oxiflow_sbp::{Region, Shape};

use crate::device_slot::DeviceSlot;
use crate::op::OutSpec;
use crate::rng::ElementInit;
use crate::storage::{CpuArray, Device, DeviceStorage, Storage};
use crate::{Result, TensorError};

/// Transfers and creation of one device type (see the module docs for the contract).
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
    /// Runs the boxing `plan` on this rank's `piece` (None outside the source placement) when
    /// `world` is this backend's (e.g. device buffers straight to NCCL), returning the new
    /// piece (None outside the target). None: not this backend's world, so the dispatcher
    /// boxes on the host. The default claims no world.
    fn run_boxing(
        &self,
        op: &'static str,
        plan: &Plan,
        world: &SharedComm,
        piece: Option<&Storage>,
    ) -> Option<Result<Option<Storage>>> {
        let _ = (op, plan, world, piece);
        None
    }
    /// Bytes in use on the device this process computes on, as its driver counts them: the
    /// whole device's (one process a device, as `oflaunch` starts them, makes it the
    /// process's), what an out-of-memory error sees. The default: not known.
    fn device_in_use(&self) -> Option<usize> {
        None
    }
    /// One allocation of `bytes` bytes on device `ordinal` for an arena (`crate::arena`). The
    /// default: unsupported, a typed error.
    fn arena(&self, bytes: usize, ordinal: usize) -> Result<Arc<dyn DeviceStorage>> {
        let _ = ordinal;
        Err(unsupported("arena", format!("an arena of {bytes} bytes")))
    }
    /// A piece of `spec` over the bytes at `offset` of `arena` (made by [`Self::arena`];
    /// aligned, inside it, checked by the caller), sharing its memory.
    fn place(
        &self,
        arena: &dyn DeviceStorage,
        offset: usize,
        spec: &OutSpec,
    ) -> Result<Arc<dyn DeviceStorage>> {
        let _ = (arena, offset);
        Err(unsupported(
            "arena",
            format!("placing {} {}", spec.dtype, spec.shape),
        ))
    }
    /// A copy of `src` in memory of its own.
    fn duplicate(&self, src: &dyn DeviceStorage) -> Result<Arc<dyn DeviceStorage>> {
        Err(unsupported("arena", format!("copying {}", src.shape())))
    }
    /// Copies `src` into `dst` (same shape and dtype, same device).
    fn copy_into(&self, src: &dyn DeviceStorage, dst: &dyn DeviceStorage) -> Result<()> {
        let _ = dst;
        Err(unsupported("arena", format!("copying {}", src.shape())))
    }
    /// Captures the work `f` queues on device `ordinal` as one graph, which runs nothing
    /// until launched (see [`DeviceGraph`]); an error when the device cannot capture it (the
    /// work then never ran). The default: unsupported.
    fn capture_graph(
        &self,
        ordinal: usize,
        f: &mut dyn FnMut() -> Result<()>,
    ) -> Result<Box<dyn DeviceGraph>> {
        let _ = (ordinal, f);
        Err(unsupported("graph", "capturing a graph".into()))
    }
    /// Why [`DeviceBackend::capture_graph`] would refuse now, before queuing anything (e.g.
    /// ops timed one by one), if it would. The default: never refused up front.
    fn graph_refusal(&self) -> Option<String> {
        None
    }
}

/// Work captured once on a device (`DeviceBackend::capture_graph`) and launched as one unit:
/// every launch runs the captured kernels and collectives on the same addresses, in the order
/// of the device's streams, after the work queued before it.
pub trait DeviceGraph: Send + Sync {
    /// Queues one run of the graph.
    fn launch(&self) -> Result<()>;
    /// Kernel, copy and collective nodes in the graph.
    fn nodes(&self) -> usize;
    /// Bytes of device memory the graph keeps for its launches besides the pieces it was
    /// given (blocks made or freed while it was captured).
    fn kept_bytes(&self) -> usize;
}

/// Captures the work `f` queues on `device` as one [`DeviceGraph`] (see
/// `DeviceBackend::capture_graph`): an error on the CPU, and where the device cannot capture.
pub fn capture_graph(
    device: Device,
    f: &mut dyn FnMut() -> Result<()>,
) -> Result<Box<dyn DeviceGraph>> {
    match device {
        Device::Cpu => Err(unsupported("graph", "capturing a graph on the cpu".into())),
        Device::Cuda(ordinal) => backend_for("graph", device)?.capture_graph(ordinal, f),
    }
}

/// Why a graph capture on `device` would be refused now, before it queued anything (the host
/// has no graphs; a device may refuse while ops are timed or traced one by one), if it would.
pub fn graph_capture_refusal(device: Device) -> Option<String> {
    match device {
        Device::Cpu => Some("the host has no device graphs".into()),
        Device::Cuda(_) => match backend_for("graph", device) {
            Ok(b) => b.graph_refusal(),
            Err(e) => Some(e.to_string()),
        },
    }
}

/// Whether collectives touched `piece` that the device's compute stream has not waited for
/// (see [`DeviceStorage::awaits_collectives`]); false on the host.
pub fn awaits_collectives(piece: &Storage) -> bool {
    match piece {
        Storage::Device(d) => d.awaits_collectives(),
        Storage::Cpu(_) => false,
    }
}

/// Orders the device's compute stream after the collectives that touched `piece` and that it
/// has not waited for (see [`DeviceStorage::order_after_collectives`]); nothing on the host.
/// Do it before a device graph is captured or launched that reads the piece: inside a capture
/// such a wait would be an operation the capture cannot record.
pub fn order_after_collectives(piece: &Storage) {
    if let Storage::Device(d) = piece {
        d.order_after_collectives();
    }
}

/// A copy of `src` in memory of its own (on its device).
pub fn duplicate_storage(src: &Storage) -> Result<Storage> {
    match src {
        Storage::Cpu(a) => Ok(Storage::Cpu(a.clone())),
        Storage::Device(d) => Ok(Storage::Device(
            backend_for("copy", d.device())?.duplicate(d.as_ref())?,
        )),
    }
}

/// Copies `src` into `dst` (the same shape and dtype, on one device; host or device).
pub fn copy_storage(src: &Storage, dst: &Storage) -> Result<()> {
    match (src, dst) {
        (Storage::Device(s), Storage::Device(d)) if s.device() == d.device() => {
            backend_for("copy", d.device())?.copy_into(s.as_ref(), d.as_ref())
        }
        (s, d) => Err(TensorError::Device {
            op: "copy",
            devices: format!("{} -> {}", s.device(), d.device()),
            shapes: format!("{} -> {}", s.shape(), d.shape()),
            detail: "a copy into a piece runs on one device".into(),
        }),
    }
}

fn unsupported(op: &'static str, what: String) -> TensorError {
    TensorError::Device {
        op,
        devices: "device".into(),
        shapes: String::new(),
        detail: format!("this backend does not support {what}"),
    }
}

static CUDA_BACKEND: DeviceSlot<dyn DeviceBackend> =
    DeviceSlot::new("backend", "the CPU backend is built in");

/// Registers the backend of a device type (only `Cuda` can be registered; CPU is built in).
pub fn register_device_backend(device: DeviceType, backend: Arc<dyn DeviceBackend>) -> Result<()> {
    CUDA_BACKEND.register("register_device_backend", device, backend)
}

/// Every registered device backend (the dispatcher offers each a boxing plan first).
pub(crate) fn registered_backends() -> impl Iterator<Item = Arc<dyn DeviceBackend>> {
    CUDA_BACKEND.cuda().into_iter()
}

/// The registered backend of `device`, or a typed error naming `op`.
pub(crate) fn backend_for(op: &'static str, device: Device) -> Result<Arc<dyn DeviceBackend>> {
    CUDA_BACKEND.of(op, device)
}
