//! Device memory from NCCL's allocator (`ncclMemAlloc`: CUDA VMM memory that NCCL can map into
//! its peers), registered with each communicator that moves it, so NCCL reads and writes it in
//! place (zero-copy over NVLink) instead of staging through its own FIFO buffers.
//!
//! Registration is by address: a collective whose device buffer lies inside an [`NcclMemory`]
//! registers that allocation with its communicator on first use (`ncclCommRegister`, a local
//! call); the registration lasts until the allocation or the communicator is dropped, whichever
//! comes first (`ncclCommDeregister`). NCCL requires both sides of a transfer to agree on
//! registration, so every rank of a program takes its collective buffers from here, or none
//! does (the tensor layer's allocator does the former on every rank of an NCCL world).

use std::collections::BTreeMap;
use std::ffi::c_void;

use super::{dev_err, lock, Arc, CommError, Inner, Mutex, Weak};
use crate::cuda_libs::LibSearch;

/// One allocation's registrations: (communicator, `ncclCommRegister` handle).
struct Entry {
    bytes: usize,
    regs: Vec<(Weak<Inner>, usize)>,
}

/// Every live `NcclMemory` by base address.
static REGISTRY: Mutex<BTreeMap<u64, Entry>> = Mutex::new(BTreeMap::new());

/// Device memory from `ncclMemAlloc`, freed (after every registration is dropped) on drop.
///
/// The owner must make sure no device work still uses the memory when it is dropped:
/// `ncclMemFree` unmaps at once (it is not ordered on a stream).
#[derive(Debug)]
pub struct NcclMemory {
    ptr: u64,
    bytes: usize,
}

impl NcclMemory {
    /// `bytes` of device memory on the calling thread's current CUDA device (bind the context
    /// first).
    pub fn alloc(bytes: usize) -> Result<NcclMemory, CommError> {
        let op = "ncclMemAlloc";
        let nccl = super::ffi::nccl(&LibSearch::default())?;
        let alloc = nccl.mem_alloc.ok_or_else(|| {
            CommError::Device(format!(
                "{op}: NCCL {} has no ncclMemAlloc (needs 2.19+)",
                nccl.path
            ))
        })?;
        let mut p: *mut c_void = std::ptr::null_mut();
        // SAFETY: writes one pointer.
        nccl.check(op, std::ptr::null_mut(), unsafe {
            alloc(&mut p, bytes.max(1))
        })
        .map_err(|e| CommError::Device(format!("{e} ({bytes} bytes)")))?;
        let ptr = p as u64;
        lock(&REGISTRY).insert(
            ptr,
            Entry {
                bytes,
                regs: Vec::new(),
            },
        );
        Ok(NcclMemory { ptr, bytes })
    }
    pub fn ptr(&self) -> u64 {
        self.ptr
    }
    pub fn len(&self) -> usize {
        self.bytes
    }
    pub fn is_empty(&self) -> bool {
        self.bytes == 0
    }
}

impl Drop for NcclMemory {
    fn drop(&mut self) {
        // Out of the registry first (a communicator dropped meanwhile then has nothing of it
        // to deregister), then deregistered from each live communicator, then freed.
        let entry = lock(&REGISTRY).remove(&self.ptr);
        for (weak, handle) in entry.map(|e| e.regs).unwrap_or_default() {
            if let Some(inner) = weak.upgrade() {
                let _calls = lock(&inner.calls);
                if let Some(dereg) = inner.nccl.comm_deregister {
                    // SAFETY: `handle` came from ncclCommRegister on this comm.
                    unsafe { dereg(inner.raw.0, handle as *mut c_void) };
                }
            }
        }
        if let Ok(nccl) = super::ffi::nccl(&LibSearch::default()) {
            if let Some(free) = nccl.mem_free {
                // SAFETY: allocated by ncclMemAlloc; no registration and (owner's contract) no
                // device work refers to it any more.
                unsafe { free(self.ptr as *mut c_void) };
            }
        }
    }
}

/// Registers with `inner` the `NcclMemory` that holds `ptr`, if any and not yet registered.
pub(super) fn ensure_registered(inner: &Arc<Inner>, op: &str, ptr: u64) -> Result<(), CommError> {
    let mut g = lock(&REGISTRY);
    let Some((&base, entry)) = g.range_mut(..=ptr).next_back() else {
        return Ok(());
    };
    if ptr >= base + entry.bytes as u64
        || entry
            .regs
            .iter()
            .any(|(w, _)| std::ptr::eq(w.as_ptr(), Arc::as_ptr(inner)))
    {
        return Ok(());
    }
    let reg = inner
        .nccl
        .comm_register
        .ok_or_else(|| CommError::Device(format!("{op}: NCCL has no ncclCommRegister")))?;
    let _calls = lock(&inner.calls);
    inner.ctx.bind_to_thread().map_err(|e| dev_err(op, e))?;
    let mut handle: *mut c_void = std::ptr::null_mut();
    // SAFETY: registers a live ncclMemAlloc allocation with a live comm; writes one handle.
    let r = unsafe { reg(inner.raw.0, base as *mut c_void, entry.bytes, &mut handle) };
    inner
        .nccl
        .check(&format!("{op}: ncclCommRegister"), inner.raw.0, r)?;
    entry.regs.push((Arc::downgrade(inner), handle as usize));
    Ok(())
}

/// Drops every registration with the communicator at `inner` (it is being destroyed;
/// `deregister` false when it was aborted, and NCCL's state for it is gone).
pub(super) fn forget_comm(inner: &Inner, deregister: bool) {
    let mut g = lock(&REGISTRY);
    for entry in g.values_mut() {
        entry.regs.retain(|(w, handle)| {
            if !std::ptr::eq(w.as_ptr(), inner) {
                return true;
            }
            if let (true, Some(dereg)) = (deregister, inner.nccl.comm_deregister) {
                // SAFETY: `handle` came from ncclCommRegister on this comm, still alive.
                unsafe { dereg(inner.raw.0, *handle as *mut c_void) };
            }
            false
        });
    }
}
