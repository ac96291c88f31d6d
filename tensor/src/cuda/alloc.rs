//! The caching device allocator: size-bucketed free lists per device runtime. Blocks return
//! to their bucket on drop; every use of a block is queued on the one compute stream, so a
//! block reused from the list is ordered after the last kernel that touched it.

use std::collections::HashMap;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::{Arc, Mutex};

use cudarc::driver::{CudaSlice, DevicePtr as _};

use super::{derr, CudaRuntime};
use crate::Result;

/// Bytes kept in the free lists at most; more is given back to the driver.
const MAX_CACHED: usize = 16 << 30;

/// The bucket of a request: powers of two up to 1 MiB, then multiples of 2 MiB.
fn bucket(bytes: usize) -> usize {
    let b = bytes.max(512);
    if b <= 1 << 20 {
        b.next_power_of_two()
    } else {
        b.div_ceil(2 << 20) * (2 << 20)
    }
}

#[derive(Default)]
pub(crate) struct Pool {
    free: Mutex<HashMap<usize, Vec<CudaSlice<u8>>>>,
    cached: AtomicUsize,
}

impl Pool {
    pub(crate) fn cached_bytes(&self) -> usize {
        self.cached.load(Ordering::Relaxed)
    }
    fn take(&self, cap: usize) -> Option<CudaSlice<u8>> {
        let mut g = self.free.lock().unwrap_or_else(|p| p.into_inner());
        let s = g.get_mut(&cap)?.pop()?;
        self.cached.fetch_sub(cap, Ordering::Relaxed);
        Some(s)
    }
    fn put(&self, cap: usize, s: CudaSlice<u8>) {
        if self.cached.load(Ordering::Relaxed) + cap > MAX_CACHED {
            return; // dropped: freed on its stream
        }
        self.cached.fetch_add(cap, Ordering::Relaxed);
        let mut g = self.free.lock().unwrap_or_else(|p| p.into_inner());
        g.entry(cap).or_default().push(s);
    }
    fn release_all(&self) {
        let mut g = self.free.lock().unwrap_or_else(|p| p.into_inner());
        g.clear();
        self.cached.store(0, Ordering::Relaxed);
    }
}

/// One device allocation of at least `bytes` bytes, back to the pool on drop.
pub struct Block {
    slice: Option<CudaSlice<u8>>,
    ptr: u64,
    bytes: usize,
    cap: usize,
    rt: Arc<CudaRuntime>,
}

impl std::fmt::Debug for Block {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(
            f,
            "Block({} of {} bytes on cuda:{})",
            self.bytes, self.cap, self.rt.ordinal
        )
    }
}

impl Block {
    /// An uninitialised block (the caller writes every byte it reads).
    pub(crate) fn alloc(rt: &Arc<CudaRuntime>, bytes: usize) -> Result<Block> {
        let cap = bucket(bytes);
        let slice = match rt.pool.take(cap) {
            Some(s) => s,
            None => {
                rt.bind("cuda alloc")?;
                // SAFETY: memory is written before it is read (callers' contract).
                match unsafe { rt.stream.alloc::<u8>(cap) } {
                    Ok(s) => s,
                    Err(_) => {
                        // Out of memory: give the cached blocks back and try once more.
                        rt.pool.release_all();
                        rt.synchronize()?;
                        unsafe { rt.stream.alloc::<u8>(cap) }.map_err(|e| {
                            derr(
                                "cuda alloc",
                                format!("{bytes} bytes on cuda:{}: {e}", rt.ordinal),
                            )
                        })?
                    }
                }
            }
        };
        let ptr = slice.device_ptr(&rt.stream).0;
        Ok(Block {
            slice: Some(slice),
            ptr,
            bytes,
            cap,
            rt: rt.clone(),
        })
    }
    pub(crate) fn ptr(&self) -> u64 {
        self.ptr
    }
    pub(crate) fn runtime(&self) -> &Arc<CudaRuntime> {
        &self.rt
    }
}

impl Drop for Block {
    fn drop(&mut self) {
        if let Some(s) = self.slice.take() {
            self.rt.pool.put(self.cap, s);
        }
    }
}

#[cfg(test)]
mod tests {
    use super::bucket;

    #[test]
    fn buckets() {
        assert_eq!(bucket(0), 512);
        assert_eq!(bucket(513), 1024);
        assert_eq!(bucket(1 << 20), 1 << 20);
        assert_eq!(bucket((1 << 20) + 1), 2 << 20);
        assert_eq!(bucket((5 << 20) + 3), 6 << 20);
    }
}
