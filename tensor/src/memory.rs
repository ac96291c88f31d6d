//! Memory accounting: live and peak bytes of host allocations (counted by [`CountingAllocator`]
//! when a program installs it as its global allocator) and of device blocks in use (the CUDA
//! pool's blocks handed to tensors, at their bucket size; cached free blocks are not counted).

use std::alloc::{GlobalAlloc, Layout, System};
use std::sync::atomic::{AtomicBool, AtomicUsize, Ordering};

/// Live bytes now and the most live at once since the last [`reset_peaks`].
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct MemoryStats {
    pub live: usize,
    pub peak: usize,
}

struct Counter {
    live: AtomicUsize,
    peak: AtomicUsize,
}

impl Counter {
    const fn new() -> Counter {
        Counter {
            live: AtomicUsize::new(0),
            peak: AtomicUsize::new(0),
        }
    }
    fn add(&self, n: usize) {
        let now = self.live.fetch_add(n, Ordering::Relaxed).saturating_add(n);
        self.peak.fetch_max(now, Ordering::Relaxed);
    }
    fn sub(&self, n: usize) {
        // Saturating: a block freed after a reset of the counts never wraps below zero.
        let _ = self
            .live
            .fetch_update(Ordering::Relaxed, Ordering::Relaxed, |v| {
                Some(v.saturating_sub(n))
            });
    }
    fn stats(&self) -> MemoryStats {
        MemoryStats {
            live: self.live.load(Ordering::Relaxed),
            peak: self.peak.load(Ordering::Relaxed),
        }
    }
    fn reset_peak(&self) {
        self.peak
            .store(self.live.load(Ordering::Relaxed), Ordering::Relaxed);
    }
}

static HOST: Counter = Counter::new();
static HOST_COUNTING: AtomicBool = AtomicBool::new(false);
static DEVICE: Counter = Counter::new();

/// The system allocator, counting live and peak bytes. Install it in a binary with
/// `#[global_allocator] static A: CountingAllocator = CountingAllocator;`.
pub struct CountingAllocator;

// SAFETY: every method forwards to `System` with the caller's arguments unchanged, so the
// `GlobalAlloc` contract holds as it does for `System`; the counters only read sizes.
unsafe impl GlobalAlloc for CountingAllocator {
    unsafe fn alloc(&self, layout: Layout) -> *mut u8 {
        // SAFETY: forwarded with the caller's (valid, non-zero-size) layout.
        let p = unsafe { System.alloc(layout) };
        if !p.is_null() {
            HOST_COUNTING.store(true, Ordering::Relaxed);
            HOST.add(layout.size());
        }
        p
    }
    unsafe fn alloc_zeroed(&self, layout: Layout) -> *mut u8 {
        // SAFETY: as `alloc`.
        let p = unsafe { System.alloc_zeroed(layout) };
        if !p.is_null() {
            HOST_COUNTING.store(true, Ordering::Relaxed);
            HOST.add(layout.size());
        }
        p
    }
    unsafe fn dealloc(&self, ptr: *mut u8, layout: Layout) {
        // SAFETY: `ptr` came from this allocator (so from `System`) with this layout.
        unsafe { System.dealloc(ptr, layout) };
        HOST.sub(layout.size());
    }
    unsafe fn realloc(&self, ptr: *mut u8, layout: Layout, new_size: usize) -> *mut u8 {
        // SAFETY: `ptr` came from `System` with `layout`; `new_size` is the caller's valid size.
        let p = unsafe { System.realloc(ptr, layout, new_size) };
        if !p.is_null() {
            HOST.sub(layout.size());
            HOST.add(new_size);
        }
        p
    }
}

/// Host bytes, when the program counts them through [`CountingAllocator`].
pub fn host() -> Option<MemoryStats> {
    HOST_COUNTING.load(Ordering::Relaxed).then(|| HOST.stats())
}

/// Device bytes in tensors' blocks (all devices of this process).
pub fn device() -> MemoryStats {
    DEVICE.stats()
}

/// Bytes in use on the device this process computes on, as its driver counts them (see
/// `DeviceBackend::device_in_use`): beside [`device`]'s own count, what the allocator's
/// caches, the libraries' workspaces and the driver's context add. None on the host, or where
/// the backend does not say.
pub fn device_in_use() -> Option<usize> {
    crate::device::registered_backends().find_map(|b| b.device_in_use())
}

/// Starts new peaks at the live counts (e.g. before the training step to measure).
pub fn reset_peaks() {
    HOST.reset_peak();
    DEVICE.reset_peak();
}

/// Counts `bytes` a device backend's allocator took from the driver for tensors' blocks.
pub fn device_alloc(bytes: usize) {
    DEVICE.add(bytes);
}

/// Counts `bytes` a device backend's allocator gave back to the driver.
pub fn device_free(bytes: usize) {
    DEVICE.sub(bytes);
}

#[cfg(test)]
mod tests {
    use super::Counter;

    #[test]
    fn peak_follows_live_and_resets() {
        let c = Counter::new();
        c.add(100);
        c.add(50);
        c.sub(120);
        assert_eq!((c.stats().live, c.stats().peak), (30, 150));
        c.reset_peak();
        assert_eq!(c.stats().peak, 30);
        c.sub(1000);
        assert_eq!(c.stats().live, 0);
    }
}
