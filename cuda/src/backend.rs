//! `CudaBackend`: the device seam's `DeviceBackend` for CUDA (uploads, device-side creation,
//! boxing in NCCL worlds: `boxing`) and its `OpExecutor` (every dispatched op through
//! `oxiflow_tensor::backend::execute` on [`CudaKernels`] (`ops/`), whose allocator takes every
//! output from the runtime's pool).

use std::sync::Arc;

use oxiflow_boxing::Plan;
use oxiflow_collectives::device_trace;
use oxiflow_collectives::trace::Lane;
use oxiflow_collectives::SharedComm;
use oxiflow_dtype::DType;
use oxiflow_sbp::{Region, Shape};
use smallvec::SmallVec;

use super::copy::copy_nd;
use super::ops::CudaKernels;
use super::storage::{cuda_of, cuda_piece, CudaStorage};
use super::{derr, runtime, Block};
use oxiflow_tensor::backend::{execute, execute_into};
use oxiflow_tensor::rng::ElementInit;
use oxiflow_tensor::OpExecutor;
use oxiflow_tensor::Result;
use oxiflow_tensor::{BackendId, Op, OutSpec};
use oxiflow_tensor::{CpuArray, DeviceStorage, Storage};
use oxiflow_tensor::{DeviceBackend, DeviceGraph};

/// The CUDA backend (stateless: the process's runtime holds the device state).
#[derive(Clone, Copy, Debug, Default)]
pub struct CudaBackend;

impl DeviceBackend for CudaBackend {
    fn from_host(&self, array: &CpuArray, _ordinal: usize) -> Result<Arc<dyn DeviceStorage>> {
        // One device per process: every ordinal maps to the bound device.
        Ok(Arc::new(CudaStorage::from_host(array)?))
    }

    fn creates(&self, _init: ElementInit, _dtype: DType) -> bool {
        true
    }

    fn create(
        &self,
        init: ElementInit,
        dtype: DType,
        shape: &Shape,
        region: &Region,
        zero: bool,
        _ordinal: usize,
    ) -> Result<Arc<dyn DeviceStorage>> {
        super::create::create(init, dtype, shape, region, zero)
    }

    fn run_boxing(
        &self,
        op: &'static str,
        plan: &Plan,
        world: &SharedComm,
        piece: Option<&Storage>,
    ) -> Option<Result<Option<Storage>>> {
        super::boxing::run_boxing_cuda(op, plan, world, piece)
    }

    fn device_in_use(&self) -> Option<usize> {
        let (free, total) = crate::bound_runtime()?.memory_info().ok()?;
        Some(total.saturating_sub(free))
    }

    /// One block of the runtime's pool, seen as `bytes / 4` f32 elements.
    fn arena(&self, bytes: usize, _ordinal: usize) -> Result<Arc<dyn DeviceStorage>> {
        let rt = runtime("arena")?;
        // The arena takes the bytes the step that planned it left cached, not more beside them.
        rt.release_cached_memory()?;
        Ok(Arc::new(CudaStorage::whole(
            Arc::new(Block::alloc(&rt, bytes)?),
            DType::F32,
            Shape::new(vec![bytes / DType::F32.size()]),
        )))
    }

    /// A view of the arena's block at `offset` (see `Block::view`).
    fn place(
        &self,
        arena: &dyn DeviceStorage,
        offset: usize,
        spec: &OutSpec,
    ) -> Result<Arc<dyn DeviceStorage>> {
        let arena = cuda_piece("arena", arena)?;
        let bytes = spec.shape.numel() * spec.dtype.size();
        let at = arena.offset + offset;
        Ok(Arc::new(CudaStorage::whole(
            Arc::new(Block::view(&arena.block, at, bytes)?),
            spec.dtype,
            spec.shape.clone(),
        )))
    }

    fn capture_graph(
        &self,
        ordinal: usize,
        f: &mut dyn FnMut() -> Result<()>,
    ) -> Result<Box<dyn DeviceGraph>> {
        super::graph::capture(ordinal, f)
    }

    fn graph_refusal(&self) -> Option<String> {
        super::graph::refusal().map(String::from)
    }

    fn duplicate(&self, src: &dyn DeviceStorage) -> Result<Arc<dyn DeviceStorage>> {
        let src = cuda_piece("copy", src)?;
        let dst = CudaStorage::alloc(src.runtime(), src.dtype, src.shape.clone())?;
        copy_whole(src, &dst)?;
        Ok(Arc::new(dst))
    }

    fn copy_into(&self, src: &dyn DeviceStorage, dst: &dyn DeviceStorage) -> Result<()> {
        copy_whole(cuda_piece("copy", src)?, cuda_piece("copy", dst)?)
    }
}

/// Copies every element of `src` into `dst` (same dtype and shape) on the compute stream.
fn copy_whole(src: &CudaStorage, dst: &CudaStorage) -> Result<()> {
    if src.dtype != dst.dtype || src.shape != dst.shape {
        return Err(derr(
            "copy",
            format!(
                "{} {} into {} {}",
                src.dtype, src.shape, dst.dtype, dst.shape
            ),
        ));
    }
    let n = src.numel();
    copy_nd(
        src.runtime(),
        "copy",
        src.dtype,
        &[n],
        src.ptr(),
        0,
        &[1],
        dst.ptr(),
        0,
        &[1],
        0,
    )
}

/// Runs `f` (an op's kernels on `inputs`' CUDA pieces) on the compute stream, timed and traced
/// as `op`.
fn on_stream<T>(
    op: &Op,
    inputs: &[&Storage],
    f: impl FnOnce(&CudaKernels, &[&CudaStorage]) -> Result<T>,
) -> Result<T> {
    let name = op.name();
    let rt = runtime(name)?;
    let kernels = CudaKernels { rt: rt.clone() };
    let mut x: SmallVec<[&CudaStorage; 3]> = SmallVec::with_capacity(inputs.len());
    for s in inputs {
        x.push(cuda_of(name, s)?);
    }
    let traced = device_trace::begin(kernels.rt.stream());
    let y = super::timing::timed(&rt, name, || f(&kernels, &x))?;
    device_trace::end(kernels.rt.stream(), Lane::CudaCompute, name, traced);
    Ok(y)
}

impl OpExecutor for CudaBackend {
    fn backend(&self) -> BackendId {
        BackendId::of::<CudaKernels>()
    }

    fn run(
        &self,
        op: &Op,
        inputs: &[&Storage],
        outs: &[OutSpec],
    ) -> Result<SmallVec<[Storage; 1]>> {
        let y = on_stream(op, inputs, |kernels, x| execute(op, kernels, x, outs))?;
        Ok(y.into_iter()
            .map(|p| Storage::Device(Arc::new(p) as Arc<dyn DeviceStorage>))
            .collect())
    }

    /// The kernels write the given pieces' blocks (views of an arena).
    fn run_into(&self, op: &Op, inputs: &[&Storage], outs: &[&Storage]) -> Result<()> {
        let mut y: SmallVec<[CudaStorage; 1]> = SmallVec::with_capacity(outs.len());
        for s in outs {
            y.push(cuda_of(op.name(), s)?.clone());
        }
        on_stream(op, inputs, |kernels, x| {
            execute_into(op, kernels, x, &mut y)
        })
    }
}
