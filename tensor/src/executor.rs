//! The executor seam: `OpExecutor`, how a device backend runs ops on its pieces (the kernel
//! side of a backend; its `DeviceBackend` is the storage side), its registry, and where
//! dispatch runs an op on one device's pieces: the built-in CPU executor (`cpu::execute`) or a
//! registered one. Every executor runs an op through `Op::execute`, so its outputs come from
//! the backend's allocator before the kernels write them.

use std::sync::Arc;

use oxiflow_placement::DeviceType;
use smallvec::SmallVec;

use crate::cpu::CpuBackend;
use crate::device_slot::DeviceSlot;
use crate::op::{BackendId, Op, OutSpec};
use crate::storage::{CpuArray, Device, Storage};
use crate::{Result, TensorError};

/// Runs ops on the pieces of one device type: the kernel side of a device backend (its
/// `DeviceBackend` is the storage side). An implementation runs `op` (with local attributes)
/// through `Op::execute` on its implementation of every op family's kernel trait, returning one
/// piece per output of `outs` (shape and dtype as given).
pub trait OpExecutor: Send + Sync {
    /// The kernel-side backend type the executor runs kernels on (`KernelBackend`): the key
    /// an extern op's kernel table is searched by.
    fn backend(&self) -> BackendId;
    fn run(&self, op: &Op, inputs: &[&Storage], outs: &[OutSpec])
        -> Result<SmallVec<[Storage; 1]>>;
    /// Runs `op` into the given output pieces (placed in an arena: one per output, of its
    /// shape and dtype), which the kernels overwrite. The default: unsupported, a typed error.
    fn run_into(&self, op: &Op, _inputs: &[&Storage], _outs: &[&Storage]) -> Result<()> {
        Err(TensorError::Device {
            op: op.name(),
            devices: String::new(),
            shapes: String::new(),
            detail: "this executor cannot run into given buffers".into(),
        })
    }
}

static CUDA_EXECUTOR: DeviceSlot<dyn OpExecutor> =
    DeviceSlot::new("op executor", "the CPU executor is built in");

/// Registers the op executor of a device type (only `Cuda`; the CPU executor is built in).
pub fn register_op_executor(device: DeviceType, executor: Arc<dyn OpExecutor>) -> Result<()> {
    CUDA_EXECUTOR.register("register_op_executor", device, executor)
}

/// The registered op executor of `device`, or a typed error naming `op`.
pub(crate) fn executor_for(op: &'static str, device: Device) -> Result<Arc<dyn OpExecutor>> {
    CUDA_EXECUTOR.of(op, device)
}

/// The kernel-side backend of `device` type (the built-in CPU backend, or the registered
/// executor's), or a typed error naming `op` when none is registered.
pub(crate) fn backend_id(op: &'static str, device: DeviceType) -> Result<BackendId> {
    match device {
        DeviceType::Cpu => Ok(BackendId::of::<CpuBackend>()),
        DeviceType::Cuda => Ok(executor_for(op, Device::Cuda(0))?.backend()),
    }
}

/// Runs `op` (local attributes) on pieces of one device through that device's executor: one
/// piece per output of `outs`, each allocated by the backend before the kernels write it.
pub(crate) fn run_kernel(
    op: &Op,
    pieces: &[&Storage],
    device: Device,
    outs: &[OutSpec],
) -> Result<SmallVec<[Storage; 1]>> {
    if device == Device::Cpu {
        let host = host_pieces(op, pieces)?;
        let out = crate::cpu::execute(op, &host, outs)?;
        return Ok(out.into_iter().map(Storage::Cpu).collect());
    }
    executor_for(op.name(), device)?.run(op, pieces, outs)
}

/// [`run_kernel`] of a single-output call.
pub(crate) fn run_kernel_one(
    op: &Op,
    pieces: &[&Storage],
    device: Device,
    out: &OutSpec,
) -> Result<Storage> {
    if device == Device::Cpu {
        let host = host_pieces(op, pieces)?;
        return Ok(Storage::Cpu(crate::cpu::execute_one(op, &host, out)?));
    }
    let outs = executor_for(op.name(), device)?.run(op, pieces, std::slice::from_ref(out))?;
    let n = outs.len();
    outs.into_iter()
        .next()
        .filter(|_| n == 1)
        .ok_or_else(|| TensorError::Kernel {
            op: op.name(),
            detail: format!("expected one output piece, got {n}"),
        })
}

fn host_pieces<'a>(op: &Op, pieces: &[&'a Storage]) -> Result<SmallVec<[&'a CpuArray; 3]>> {
    let mut host: SmallVec<[&CpuArray; 3]> = SmallVec::new();
    for p in pieces {
        host.push(p.cpu(op.name())?);
    }
    Ok(host)
}
