//! `GuardedAllocator`: the global allocator of the `train` program. It counts host bytes as
//! `CountingAllocator` does; an allocation the system refuses (an address-space or data limit,
//! an exhausted host or cgroup) ends the process with one line naming the size and the limits in
//! force, exit code 1, instead of Rust's abort (SIGABRT, "memory allocation of N bytes failed").
//! The memory estimate refuses what cannot fit before anything big is allocated; this is the
//! floor under what it does not count.

use std::alloc::{GlobalAlloc, Layout};
use std::fmt::Write;

use nix::sys::resource::{getrlimit, Resource, RLIM_INFINITY};
use oxiflow_tensor::memory::CountingAllocator;

/// See the module docs. Install with
/// `#[global_allocator] static A: GuardedAllocator = GuardedAllocator;`.
pub struct GuardedAllocator;

/// A message built on the stack (nothing may be allocated once memory is refused).
struct Line {
    buf: [u8; 640],
    len: usize,
}

impl Write for Line {
    fn write_str(&mut self, s: &str) -> std::fmt::Result {
        let n = s.len().min(self.buf.len() - self.len);
        self.buf[self.len..self.len + n].copy_from_slice(&s.as_bytes()[..n]);
        self.len += n;
        Ok(())
    }
}

/// `bytes` in GiB, MiB or KiB with two decimals, or bytes (no allocation).
fn write_size(out: &mut Line, bytes: u64) {
    const UNITS: [(&str, u64); 3] = [("GiB", 1 << 30), ("MiB", 1 << 20), ("KiB", 1 << 10)];
    match UNITS.iter().find(|(_, u)| bytes >= *u) {
        Some((name, u)) => {
            let hundredths = bytes as u128 * 100 / *u as u128;
            let _ = write!(out, "{}.{:02} {name}", hundredths / 100, hundredths % 100);
        }
        None => {
            let _ = write!(out, "{bytes} B");
        }
    }
}

/// Writes why `size` bytes could not be allocated and ends the process (exit code 1).
#[cold]
fn refused(size: usize) -> ! {
    let mut line = Line {
        buf: [0; 640],
        len: 0,
    };
    let _ = write!(line, "train: out of host memory: an allocation of ");
    write_size(&mut line, size as u64);
    let _ = write!(line, " ({size} bytes) was refused");
    let mut limited = false;
    for (resource, name) in [
        (
            Resource::RLIMIT_AS,
            "the address-space limit RLIMIT_AS (ulimit -v)",
        ),
        (
            Resource::RLIMIT_DATA,
            "the data-segment limit RLIMIT_DATA (ulimit -d)",
        ),
    ] {
        if let Ok((soft, _)) = getrlimit(resource) {
            if soft != RLIM_INFINITY {
                let _ = write!(line, "; {name} is ");
                write_size(&mut line, soft);
                limited = true;
            }
        }
    }
    if !limited {
        let _ = write!(
            line,
            "; no address-space limit is set, so the host or its cgroup ran out"
        );
    }
    let _ = writeln!(
        line,
        ": lower --batch-size or the model's size, run on more ranks, or raise the limit"
    );
    // SAFETY: writes the initialised bytes of `line` to stderr and ends the process without
    // running anything that could allocate; both are async-signal-safe system calls.
    unsafe {
        libc::write(2, line.buf.as_ptr().cast(), line.len);
        libc::_exit(1)
    }
}

// SAFETY: every method forwards to `CountingAllocator` (which forwards to `System`) with the
// caller's arguments unchanged, so the `GlobalAlloc` contract holds as it does there; a null
// result ends the process instead of being returned.
unsafe impl GlobalAlloc for GuardedAllocator {
    unsafe fn alloc(&self, layout: Layout) -> *mut u8 {
        // SAFETY: forwarded with the caller's (valid, non-zero-size) layout.
        let p = unsafe { CountingAllocator.alloc(layout) };
        if p.is_null() {
            refused(layout.size());
        }
        p
    }
    unsafe fn alloc_zeroed(&self, layout: Layout) -> *mut u8 {
        // SAFETY: as `alloc`.
        let p = unsafe { CountingAllocator.alloc_zeroed(layout) };
        if p.is_null() {
            refused(layout.size());
        }
        p
    }
    unsafe fn dealloc(&self, ptr: *mut u8, layout: Layout) {
        // SAFETY: `ptr` came from this allocator (so from `CountingAllocator`) with `layout`.
        unsafe { CountingAllocator.dealloc(ptr, layout) }
    }
    unsafe fn realloc(&self, ptr: *mut u8, layout: Layout, new_size: usize) -> *mut u8 {
        // SAFETY: `ptr` came from `CountingAllocator` with `layout`; `new_size` is the caller's.
        let p = unsafe { CountingAllocator.realloc(ptr, layout, new_size) };
        if p.is_null() {
            refused(new_size);
        }
        p
    }
}
