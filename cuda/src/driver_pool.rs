//! The device's stream-ordered memory pool (the one `cuMemAllocAsync` draws from): the caching
//! allocator returns its large blocks to it (`alloc::Pool`'s `driver_from`), and the pool then
//! serves any size from their bytes, on the compute stream, in stream order. Told to keep what
//! is freed to it (a release threshold of "everything"), it does not give memory back to the
//! driver at each synchronisation; after an out-of-memory it is trimmed to what live blocks use.

use cudarc::driver::sys::{CUmemPool_attribute, CUmemoryPool};
use cudarc::driver::CudaContext;

/// The default memory pool of `ctx`'s device (the context is bound by the caller).
fn default_pool(ctx: &CudaContext) -> Result<CUmemoryPool, String> {
    let dev =
        cudarc::driver::result::device::get(ctx.ordinal() as i32).map_err(|e| e.to_string())?;
    // SAFETY: `dev` was just returned by `cuDeviceGet`.
    unsafe { cudarc::driver::result::device::get_default_mem_pool(dev) }.map_err(|e| e.to_string())
}

/// Makes the pool keep the bytes freed to it (until [`trim`]).
pub(crate) fn keep_freed(ctx: &CudaContext) -> Result<(), String> {
    let pool = default_pool(ctx)?;
    let mut keep_all = u64::MAX;
    // SAFETY: `pool` is the device's valid default pool; the release threshold is a u64.
    unsafe {
        cudarc::driver::result::mem_pool::set_attribute(
            pool,
            CUmemPool_attribute::CU_MEMPOOL_ATTR_RELEASE_THRESHOLD,
            (&mut keep_all as *mut u64).cast(),
        )
    }
    .map_err(|e| e.to_string())
}

/// Gives the pool's unused bytes back to the driver (after the stream synchronised, so the
/// frees queued on it have happened).
pub(crate) fn trim(ctx: &CudaContext) -> Result<(), String> {
    let pool = default_pool(ctx)?;
    // SAFETY: `pool` is the device's valid default pool.
    unsafe { cudarc::driver::result::mem_pool::trim_to(pool, 0) }.map_err(|e| e.to_string())
}

/// The most bytes the pool ever reserved from the driver (its high-water mark), if the driver
/// says.
pub(crate) fn reserved_high(ctx: &CudaContext) -> Option<usize> {
    let pool = default_pool(ctx).ok()?;
    let mut high = 0u64;
    // SAFETY: `pool` is valid; the attribute is a u64 written into `high`.
    unsafe {
        cudarc::driver::result::mem_pool::get_attribute(
            pool,
            CUmemPool_attribute::CU_MEMPOOL_ATTR_RESERVED_MEM_HIGH,
            (&mut high as *mut u64).cast(),
        )
    }
    .ok()?;
    usize::try_from(high).ok()
}
