//! Arenas: one allocation on one device (the host, or a CUDA device through its backend), with
//! pieces placed at fixed byte offsets in it, so a program whose memory was planned ahead runs
//! every step in the same bytes: [`Arena::place`] gives a [`PlacedPiece`] (a view of the
//! arena's bytes at an offset with a shape and dtype, no allocation), [`run_kernel_into`] runs
//! an op's kernels into placed outputs, and a placed piece is copied out
//! ([`PlacedPiece::to_owned_storage`]) only where a value must outlive the arena's next use.
//!
//! On the host a placed piece is a `CpuArray` whose vector points into the arena; it is never
//! dropped as a vector (its release forgets the vector), so the arena alone owns the memory.
//! Placed pieces are only lent to kernels by reference, never shared as `Arc<Storage>`, so no
//! piece of the arena outlives the place it was given.

use std::alloc::Layout;
use std::ptr::NonNull;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::Arc;

use ndarray::{ArrayD, IxDyn};
use oxiflow_dtype::with_element;
use smallvec::SmallVec;

use crate::cpu;
use crate::device::{backend_for, duplicate_storage};
use crate::element::TensorElement;
use crate::executor::executor_for;
use crate::op::{Op, OutSpec};
use crate::storage::{CpuArray, Device, DeviceStorage, Storage};
use crate::{with_array, Result, TensorError};

/// Alignment of an arena's base address and of every offset placed in it.
pub const ARENA_ALIGN: usize = 256;

/// Arenas allocated by this process so far (a replay that reuses its arena adds none).
static ALLOCATED: AtomicUsize = AtomicUsize::new(0);

/// How many arenas this process has allocated.
pub fn arenas_allocated() -> usize {
    ALLOCATED.load(Ordering::Relaxed)
}

fn arena_err(detail: String) -> TensorError {
    TensorError::Kernel {
        op: "arena",
        detail,
    }
}

/// One host allocation, aligned to [`ARENA_ALIGN`].
struct HostBlock {
    ptr: NonNull<u8>,
    layout: Option<Layout>,
}

// SAFETY: the block is plain memory owned by this value; which thread frees it does not matter,
// and every access goes through placed pieces whose users serialise them (one replay at once).
unsafe impl Send for HostBlock {}
// SAFETY: as above; shared references never write through the pointer themselves.
unsafe impl Sync for HostBlock {}

impl Drop for HostBlock {
    fn drop(&mut self) {
        if let Some(layout) = self.layout {
            // SAFETY: `ptr` came from `alloc_zeroed` with this very layout, and every placed
            // piece (which holds an `Arc` of the arena) is gone, so nothing points into it.
            unsafe { std::alloc::dealloc(self.ptr.as_ptr(), layout) };
        }
    }
}

enum ArenaMem {
    Host(HostBlock),
    Device(Arc<dyn DeviceStorage>),
}

/// One arena of `bytes` bytes on `device` (see the module docs).
pub struct Arena {
    mem: Arc<ArenaMem>,
    bytes: usize,
    device: Device,
}

impl std::fmt::Debug for Arena {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "Arena({} bytes on {})", self.bytes, self.device)
    }
}

impl Arena {
    /// A zeroed arena of `bytes` bytes on `device` (one allocation; none for 0 bytes).
    pub fn new(device: Device, bytes: usize) -> Result<Arena> {
        let mem = match device {
            Device::Cpu => {
                let block = if bytes == 0 {
                    HostBlock {
                        ptr: NonNull::<[u8; ARENA_ALIGN]>::dangling().cast(),
                        layout: None,
                    }
                } else {
                    let layout = Layout::from_size_align(bytes, ARENA_ALIGN)
                        .map_err(|e| arena_err(format!("{bytes} bytes: {e}")))?;
                    // SAFETY: the layout has a non-zero size.
                    let p = unsafe { std::alloc::alloc_zeroed(layout) };
                    let ptr = NonNull::new(p).ok_or_else(|| {
                        arena_err(format!("out of host memory for {bytes} bytes"))
                    })?;
                    HostBlock {
                        ptr,
                        layout: Some(layout),
                    }
                };
                ArenaMem::Host(block)
            }
            Device::Cuda(ordinal) => {
                ArenaMem::Device(backend_for("arena", device)?.arena(bytes, ordinal)?)
            }
        };
        ALLOCATED.fetch_add(1, Ordering::Relaxed);
        Ok(Arena {
            mem: Arc::new(mem),
            bytes,
            device,
        })
    }

    pub fn bytes(&self) -> usize {
        self.bytes
    }

    pub fn device(&self) -> Device {
        self.device
    }

    /// The address of the arena's first byte (host arenas; device arenas report 0), which
    /// stays the same for the arena's life.
    pub fn host_address(&self) -> usize {
        match &*self.mem {
            ArenaMem::Host(b) => b.ptr.as_ptr() as usize,
            ArenaMem::Device(_) => 0,
        }
    }

    /// A piece of `spec` at byte `offset` (aligned to [`ARENA_ALIGN`], inside the arena). Its
    /// bytes are whatever the arena holds there: a kernel writing it zeroes them first.
    pub fn place(&self, offset: usize, spec: &OutSpec) -> Result<PlacedPiece> {
        place_in(
            &self.mem,
            self.bytes,
            self.device,
            offset,
            spec,
            ARENA_ALIGN,
        )
    }
}

/// [`Arena::place`] in the arena `mem` of `arena_bytes` bytes on `device`, at an offset that
/// is a multiple of `align` (a multiple of the element's size and alignment).
fn place_in(
    mem: &Arc<ArenaMem>,
    arena_bytes: usize,
    device: Device,
    offset: usize,
    spec: &OutSpec,
    align: usize,
) -> Result<PlacedPiece> {
    let bytes = spec
        .shape
        .checked_numel()
        .and_then(|n| n.checked_mul(spec.dtype.size()))
        .ok_or_else(|| arena_err(format!("{} {} overflows", spec.dtype, spec.shape)))?;
    if !offset.is_multiple_of(align) || offset.checked_add(bytes).is_none_or(|e| e > arena_bytes) {
        return Err(arena_err(format!(
            "{} {} ({bytes} bytes) at offset {offset} does not fit an arena of \
             {arena_bytes} bytes aligned to {align}",
            spec.dtype, spec.shape
        )));
    }
    let storage = match &**mem {
        ArenaMem::Host(block) => {
            // SAFETY: `offset + bytes` lies inside the block (checked above), so the pointer
            // stays in the allocation.
            let base = unsafe { block.ptr.as_ptr().add(offset) };
            Storage::Cpu(host_array(base, spec))
        }
        ArenaMem::Device(arena) => {
            Storage::Device(backend_for("arena", device)?.place(arena.as_ref(), offset, spec)?)
        }
    };
    Ok(PlacedPiece {
        storage: Some(storage),
        offset,
        bytes,
        arena_bytes,
        mem: mem.clone(),
    })
}

/// A host array of `spec` over the arena bytes at `base` (aligned, inside the arena, room for
/// the whole array). Its vector must never be dropped: [`disarm`] ends it.
fn host_array(base: *mut u8, spec: &OutSpec) -> CpuArray {
    fn make<T: TensorElement>(base: *mut u8, dims: &[usize]) -> CpuArray {
        let n: usize = dims.iter().product();
        let v: Vec<T> = if n == 0 {
            Vec::new()
        } else {
            // SAFETY: `base` is aligned to ARENA_ALIGN or to the element's size (`place_in`
            // checks the offset; either is a multiple of the element's alignment) and has room
            // for `n` elements inside the arena's allocation, which outlives the array (the
            // placed piece holds the arena). The vector is never dropped, grown or
            // shrunk: `disarm` forgets it, so the allocator never sees this pointer; the
            // arena alone allocates and frees the memory.
            unsafe { Vec::from_raw_parts(base.cast::<T>(), n, n) }
        };
        // SAFETY: `v` holds exactly the product of `dims` elements.
        T::wrap(unsafe { ArrayD::from_shape_vec_unchecked(IxDyn(dims), v) })
    }
    with_element!(spec.dtype, T => make::<T>(base, spec.shape.dims()))
}

/// Ends a host array made by [`host_array`] without freeing its memory (its shape is freed).
fn disarm(a: CpuArray) {
    with_array!(a, arr => std::mem::forget(arr.into_raw_vec_and_offset().0));
}

/// A piece placed in an arena (see [`Arena::place`]); it keeps the arena alive.
pub struct PlacedPiece {
    /// None only while [`run_kernel_into`] lends a host array to the kernels.
    storage: Option<Storage>,
    offset: usize,
    bytes: usize,
    arena_bytes: usize,
    mem: Arc<ArenaMem>,
}

impl std::fmt::Debug for PlacedPiece {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "PlacedPiece({} bytes at {})", self.bytes, self.offset)
    }
}

impl Drop for PlacedPiece {
    fn drop(&mut self) {
        if let Some(Storage::Cpu(a)) = self.storage.take() {
            disarm(a);
        }
    }
}

fn taken() -> TensorError {
    arena_err("a placed piece is lent to a kernel".into())
}

impl PlacedPiece {
    /// The piece, for kernels to read.
    pub fn storage(&self) -> Result<&Storage> {
        self.storage.as_ref().ok_or_else(taken)
    }

    /// Byte offset in the arena.
    pub fn offset(&self) -> usize {
        self.offset
    }

    /// An owned copy of the piece (for a value the caller keeps past the arena's next use).
    pub fn to_owned_storage(&self) -> Result<Storage> {
        duplicate_storage(self.storage()?)
    }

    /// Writes `src` (same shape and dtype, same device) into the piece.
    pub fn write_from(&mut self, src: &Storage) -> Result<()> {
        match (self.storage.as_mut().ok_or_else(taken)?, src) {
            (Storage::Cpu(dst), Storage::Cpu(s)) => cpu::copy_into(s, dst),
            (Storage::Device(dst), Storage::Device(s)) => {
                backend_for("arena", dst.device())?.copy_into(s.as_ref(), dst.as_ref())
            }
            (dst, s) => Err(arena_err(format!(
                "cannot write a piece on {} into one on {}",
                s.device(),
                dst.device()
            ))),
        }
    }

    /// A view of this piece's bytes from byte `at` as `spec` (same dtype, inside the piece):
    /// the piece a reshape of this one gives (`at` 0), or a run of its elements.
    pub fn view_at(&self, at: usize, spec: &OutSpec) -> Result<PlacedPiece> {
        let storage = self.storage()?;
        let size = storage.dtype().size();
        let fits = spec
            .shape
            .checked_numel()
            .and_then(|n| n.checked_mul(size))
            .and_then(|bytes| bytes.checked_add(at))
            .is_some_and(|end| end <= self.bytes);
        if spec.dtype != storage.dtype() || !at.is_multiple_of(size) || !fits {
            return Err(arena_err(format!(
                "cannot view {} {} from byte {at} as {} {}",
                storage.dtype(),
                storage.shape(),
                spec.dtype,
                spec.shape
            )));
        }
        place_in(
            &self.mem,
            self.arena_bytes,
            storage.device(),
            self.offset + at,
            spec,
            size,
        )
    }
}

/// Sets every element of `a` to zero.
fn zero(a: &mut CpuArray) {
    fn fill<T: TensorElement>(a: &mut ArrayD<T>) {
        a.fill(T::from_f64(0.0));
    }
    with_array!(a, arr => fill(arr));
}

/// Lends host arrays to kernels; ends any still held (a kernel that panicked) without freeing
/// their memory.
struct Lent(SmallVec<[CpuArray; 1]>);

impl Drop for Lent {
    fn drop(&mut self) {
        for a in self.0.drain(..) {
            disarm(a);
        }
    }
}

/// Runs `op` (local attributes) on this rank's `pieces` into the placed `outs` (one per output,
/// of its shape and dtype), as [`crate::capture::run_local_kernel`] does into allocated ones:
/// the same kernels, so the same results. Host outputs are zeroed first (the host allocator's
/// buffers start zeroed).
pub fn run_kernel_into(
    op: &Op,
    pieces: &[&Storage],
    device: Device,
    outs: &mut [PlacedPiece],
) -> Result<()> {
    if device != Device::Cpu {
        let targets: SmallVec<[&Storage; 1]> = outs
            .iter()
            .map(PlacedPiece::storage)
            .collect::<Result<_>>()?;
        return executor_for(op.name(), device)?.run_into(op, pieces, &targets);
    }
    let mut host: SmallVec<[&CpuArray; 3]> = SmallVec::new();
    for p in pieces {
        host.push(p.cpu(op.name())?);
    }
    if !outs
        .iter()
        .all(|o| matches!(o.storage, Some(Storage::Cpu(_))))
    {
        return Err(arena_err(format!(
            "{}: a host kernel's outputs must be placed in a host arena",
            op.name()
        )));
    }
    let mut lent = Lent(SmallVec::new());
    for o in outs.iter_mut() {
        if let Some(Storage::Cpu(a)) = o.storage.take() {
            lent.0.push(a);
        }
    }
    for a in lent.0.iter_mut() {
        zero(a);
    }
    let ran = cpu::execute_into(op, &host, &mut lent.0);
    for (o, a) in outs.iter_mut().zip(lent.0.drain(..)) {
        o.storage = Some(Storage::Cpu(a));
    }
    ran
}
