//! `CudaStorage`: one immutable, row-major local piece in a pooled device block, and the host
//! <-> device copies on the compute stream.

use std::any::Any;
use std::sync::Arc;

use ndarray::{ArrayD, IxDyn};
use oxiflow_dtype::{with_element, DType};
use oxiflow_sbp::Shape;

use super::{derr, runtime, Block, CudaRuntime};
use oxiflow_tensor::with_array;
use oxiflow_tensor::CpuArray;
use oxiflow_tensor::Result;
use oxiflow_tensor::TensorElement;
use oxiflow_tensor::{Device, DeviceStorage, HostRead, Storage};

/// A local piece on the process's CUDA device: `shape`'s elements from byte `offset` of a
/// pooled block. Reshapes share the block; so do element views (`range`; blocks are
/// never written once a piece holds them, so the pieces sharing one never see each other), and
/// a collective on one of them fences the whole block. An arena's placed pieces are instead
/// `Block::view`s, each with its own fences, since the arena's bytes are written again by
/// every replay.
#[derive(Clone, Debug)]
pub struct CudaStorage {
    pub(crate) block: Arc<Block>,
    pub(crate) offset: usize,
    pub(crate) dtype: DType,
    pub(crate) shape: Shape,
}

/// Queues a host -> device copy of `src` to `dst`.
pub fn upload<T: Copy>(rt: &CudaRuntime, dst: u64, src: &[T], op: &'static str) -> Result<()> {
    if src.is_empty() {
        return Ok(());
    }
    rt.bind(op)?;
    // While a graph is captured the copy reads its source at every launch: a pinned copy
    // that lives with the graph.
    if let Some(graph) = rt.pool.capture() {
        // SAFETY: `src` is plain `Copy` data; its bytes are read as bytes.
        let bytes = unsafe {
            std::slice::from_raw_parts(src.as_ptr().cast::<u8>(), std::mem::size_of_val(src))
        };
        let kept = graph
            .upload_source(bytes)
            .map_err(|e| derr(op, format!("pinned copy for a captured upload: {e}")))?;
        // SAFETY: dst holds at least kept.len() bytes; `kept` lives as long as the graph.
        return unsafe {
            cudarc::driver::result::memcpy_htod_async(dst, kept, rt.stream().cu_stream())
        }
        .map_err(|e| derr(op, format!("host to device copy: {e}")));
    }
    // SAFETY: dst holds at least size_of_val(src) bytes; a pageable source is staged by the
    // driver before the call returns.
    unsafe { cudarc::driver::result::memcpy_htod_async(dst, src, rt.stream().cu_stream()) }
        .map_err(|e| derr(op, format!("host to device copy: {e}")))
}

/// Copies device memory at `src` into `dst` (waits for the compute stream).
pub fn download<T: Copy>(
    rt: &CudaRuntime,
    src: u64,
    dst: &mut [T],
    op: &'static str,
) -> Result<()> {
    if dst.is_empty() {
        return Ok(());
    }
    rt.bind(op)?;
    // SAFETY: src holds at least size_of_val(dst) bytes; we wait before reading dst.
    unsafe { cudarc::driver::result::memcpy_dtoh_async(dst, src, rt.stream().cu_stream()) }
        .map_err(|e| derr(op, format!("device to host copy: {e}")))?;
    rt.stream()
        .synchronize()
        .map_err(|e| derr(op, format!("waiting for the device: {e}")))
}

impl CudaStorage {
    /// An uninitialised piece (every element is written by the caller before it is read).
    pub(crate) fn alloc(rt: &Arc<CudaRuntime>, dtype: DType, shape: Shape) -> Result<CudaStorage> {
        let block = Block::alloc(rt, shape.numel() * dtype.size())?;
        Ok(CudaStorage::whole(Arc::new(block), dtype, shape))
    }
    /// The piece that starts at the start of `block`.
    pub(crate) fn whole(block: Arc<Block>, dtype: DType, shape: Shape) -> CudaStorage {
        CudaStorage {
            block,
            offset: 0,
            dtype,
            shape,
        }
    }
    pub(crate) fn bytes(&self) -> usize {
        self.numel() * self.dtype.size()
    }
    /// Uploads a host array.
    pub fn from_host(array: &CpuArray) -> Result<CudaStorage> {
        let op = "to cuda";
        let rt = runtime(op)?;
        let a = array.clone().into_standard();
        let s = CudaStorage::alloc(&rt, a.dtype(), Shape::from(a.shape()))?;
        let p = s.ptr();
        with_array!(&a, x => upload(&rt, p, x.as_slice().unwrap_or(&[]), op)?);
        Ok(s)
    }
    /// The device address of the piece's first element (what a kernel is given).
    pub fn ptr(&self) -> u64 {
        self.block.ptr() + self.offset as u64
    }
    /// The runtime of the device the piece lives on.
    pub fn runtime(&self) -> &Arc<CudaRuntime> {
        self.block.runtime()
    }
    pub fn dtype(&self) -> DType {
        self.dtype
    }
    /// Queues a copy of host data `src` into the piece's first bytes on the compute stream (a
    /// copy a captured graph keeps and repeats at every launch); a typed error naming `op`
    /// when it does not fit.
    pub fn write_from_host<T: Copy>(&self, op: &'static str, src: &[T]) -> Result<()> {
        let bytes = std::mem::size_of_val(src);
        if bytes > self.bytes() {
            return Err(derr(
                op,
                format!(
                    "{bytes} bytes do not fit a piece of {} {}",
                    self.dtype, self.shape
                ),
            ));
        }
        upload(self.runtime(), self.ptr(), src, op)
    }
    pub fn shape(&self) -> &Shape {
        &self.shape
    }
    pub fn numel(&self) -> usize {
        self.shape.numel()
    }
    /// Elements `start..start + shape.numel()` under `shape`, sharing the block (no copy);
    /// None when they do not fit.
    pub(crate) fn range(&self, start: usize, shape: &Shape) -> Option<CudaStorage> {
        let end = start.checked_add(shape.checked_numel()?)?;
        (end <= self.numel()).then(|| CudaStorage {
            block: self.block.clone(),
            offset: self.offset + start * self.dtype.size(),
            dtype: self.dtype,
            shape: shape.clone(),
        })
    }
    /// The same elements under another shape (no copy).
    pub(crate) fn reshaped(&self, shape: Shape) -> CudaStorage {
        CudaStorage {
            block: self.block.clone(),
            offset: self.offset,
            dtype: self.dtype,
            shape,
        }
    }
}

fn host<T: TensorElement + Default>(s: &CudaStorage, op: &'static str) -> Result<CpuArray> {
    let mut v = vec![T::default(); s.numel()];
    download(s.runtime(), s.ptr(), &mut v, op)?;
    let a = ArrayD::from_shape_vec(IxDyn(s.shape.dims()), v).map_err(|e| derr(op, e))?;
    Ok(T::wrap(a))
}

/// Page-locked host memory a device copy writes into while the host does other work.
struct PinnedBytes {
    ptr: *mut std::ffi::c_void,
    len: usize,
}

// SAFETY: the allocation is owned by this value alone (nothing else holds the pointer), so
// moving the value to another thread moves that ownership with it.
unsafe impl Send for PinnedBytes {}

impl PinnedBytes {
    fn alloc(len: usize, op: &'static str) -> Result<PinnedBytes> {
        // SAFETY: a fresh allocation of len (> 0) bytes; the caller bound the context.
        let ptr = unsafe { cudarc::driver::result::malloc_host(len, 0) }
            .map_err(|e| derr(op, format!("page-locked host memory of {len} bytes: {e}")))?;
        Ok(PinnedBytes { ptr, len })
    }
    fn bytes_mut(&mut self) -> &mut [u8] {
        // SAFETY: `ptr` holds `len` bytes owned by this value.
        unsafe { std::slice::from_raw_parts_mut(self.ptr.cast::<u8>(), self.len) }
    }
}

impl Drop for PinnedBytes {
    fn drop(&mut self) {
        if self.ptr.is_null() {
            return;
        }
        // SAFETY: `ptr` came from malloc_host and is freed once, here. A failure leaks it.
        let _ = unsafe { cudarc::driver::result::free_host(self.ptr) };
    }
}

/// A piece's copy to the host queued on the compute stream, the event after it, and the
/// piece (its block stays allocated until the copy is done).
struct CudaHostRead {
    pinned: PinnedBytes,
    done: cudarc::driver::CudaEvent,
    piece: CudaStorage,
}

/// `bytes` as a host array of `T` shaped `shape`.
fn host_from_bytes<T: TensorElement + Default>(
    bytes: &[u8],
    shape: &Shape,
    op: &'static str,
) -> Result<CpuArray> {
    let mut v = vec![T::default(); shape.numel()];
    // SAFETY: `T` is a plain element type; its bytes are written as bytes, and `v` holds
    // exactly bytes.len() of them (the piece's element count times the element size).
    let dst = unsafe {
        std::slice::from_raw_parts_mut(v.as_mut_ptr().cast::<u8>(), std::mem::size_of_val(&v[..]))
    };
    if dst.len() != bytes.len() {
        return Err(derr(
            op,
            format!("{} bytes read for {} {}", bytes.len(), T::DTYPE, shape),
        ));
    }
    dst.copy_from_slice(bytes);
    let a = ArrayD::from_shape_vec(IxDyn(shape.dims()), v).map_err(|e| derr(op, e))?;
    Ok(T::wrap(a))
}

impl HostRead for CudaHostRead {
    fn wait(mut self: Box<Self>) -> Result<CpuArray> {
        let op = "to host";
        self.done
            .synchronize()
            .map_err(|e| derr(op, format!("waiting for the device: {e}")))?;
        let (dtype, shape) = (self.piece.dtype, self.piece.shape.clone());
        let bytes = self.pinned.bytes_mut();
        with_element!(dtype, T => host_from_bytes::<T>(bytes, &shape, op))
    }
}

impl Drop for CudaHostRead {
    fn drop(&mut self) {
        // A read dropped unwaited (its caller failed) keeps the page-locked memory until the
        // copy into it is done; a failed wait leaves it allocated rather than freed under
        // the copy.
        if self.done.synchronize().is_err() {
            std::mem::forget(std::mem::replace(
                &mut self.pinned,
                PinnedBytes {
                    ptr: std::ptr::null_mut(),
                    len: 0,
                },
            ));
        }
    }
}

impl DeviceStorage for CudaStorage {
    fn device(&self) -> Device {
        Device::Cuda(self.block.runtime().ordinal())
    }
    fn dtype(&self) -> DType {
        self.dtype
    }
    fn shape(&self) -> &Shape {
        &self.shape
    }
    fn to_host(&self) -> Result<CpuArray> {
        let op = "to host";
        with_element!(self.dtype, T => host::<T>(self, op))
    }
    fn start_host_read(&self) -> Result<Box<dyn HostRead>> {
        let op = "to host";
        let len = self.bytes();
        if len == 0 {
            return Ok(Box::new(oxiflow_tensor::ReadDone(self.to_host()?)));
        }
        let rt = self.runtime();
        rt.bind(op)?;
        let mut pinned = PinnedBytes::alloc(len, op)?;
        // Taking the address orders the compute stream after the collectives on the block.
        let src = self.ptr();
        // SAFETY: `src` holds `len` bytes; the page-locked destination holds as many and is
        // read only after the event behind the copy completes (`wait`).
        unsafe {
            cudarc::driver::result::memcpy_dtoh_async(
                pinned.bytes_mut(),
                src,
                rt.stream().cu_stream(),
            )
        }
        .map_err(|e| derr(op, format!("device to host copy: {e}")))?;
        let done = rt
            .stream()
            .record_event(None)
            .map_err(|e| derr(op, format!("event after a device to host copy: {e}")))?;
        Ok(Box::new(CudaHostRead {
            pinned,
            done,
            piece: self.clone(),
        }))
    }
    fn as_any(&self) -> &dyn Any {
        self
    }
    fn memory_is_its_own(&self) -> bool {
        Arc::strong_count(&self.block) == 1
    }
    fn order_after_collectives(&self) {
        // The address is not used: taking it orders the compute stream after the block's
        // collectives.
        let _ = self.block.ptr();
    }
    fn awaits_collectives(&self) -> bool {
        self.block.awaits_collectives()
    }
}

/// The CUDA piece inside a storage, or a typed error naming `op`.
pub(crate) fn cuda_of<'a>(op: &'static str, s: &'a Storage) -> Result<&'a CudaStorage> {
    match s {
        Storage::Device(d) => cuda_piece(op, d.as_ref()),
        Storage::Cpu(_) => Err(derr(op, "expected a CUDA piece, got host storage")),
    }
}

/// The CUDA piece behind a device storage, or a typed error naming `op`.
pub(crate) fn cuda_piece<'a>(
    op: &'static str,
    d: &'a dyn DeviceStorage,
) -> Result<&'a CudaStorage> {
    d.as_any()
        .downcast_ref::<CudaStorage>()
        .ok_or_else(|| derr(op, format!("piece on {} is not CUDA storage", d.device())))
}
