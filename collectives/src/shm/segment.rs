//! One rank's shared-memory segment: a file under /dev/shm named with the job nonce (unlinked
//! once every same-host peer has mapped it), holding a doorbell (futex word), two slot headers
//! (post words, tag info, per-reader acks) and two data slots, each with a metadata area.

use std::ffi::CString;
use std::sync::atomic::{AtomicU32, AtomicU64, Ordering};

use crate::CommError;

/// Payload bytes of one slot (two per rank, so a rank's slots fit in L3 next to its peers').
pub(crate) const SLOT_BYTES: usize = 2 << 20;
const MAGIC: u64 = u64::from_le_bytes(*b"OXFSHM01");
const LINE: usize = 64;
const PAGE: usize = 4096;
const DOORBELL: usize = 64;
const HEADERS: usize = 128;
const ACKS: usize = 256;
/// Metadata bytes per rank and slot: four words (a strided all-to-all piece's length,
/// address, run and stride).
const META_BYTES: usize = 32;

fn align_up(x: usize, a: usize) -> usize {
    x.div_ceil(a) * a
}

/// Byte layout of a segment for a world of `world` ranks.
#[derive(Clone, Copy, Debug)]
pub(crate) struct Layout {
    world: usize,
    meta: usize,
    data: usize,
    slot_stride: usize,
    pub len: usize,
}

impl Layout {
    pub fn new(world: usize) -> Layout {
        let acks_end = ACKS + 2 * world * LINE;
        let meta = align_up(acks_end, PAGE);
        let meta_len = align_up(world * META_BYTES, PAGE);
        let data = meta + 2 * meta_len;
        let slot_stride = SLOT_BYTES;
        Layout {
            world,
            meta,
            data,
            slot_stride,
            len: data + 2 * slot_stride,
        }
    }
}

/// A mapped segment (ours or a peer's).
pub(crate) struct Segment {
    ptr: *mut u8,
    layout: Layout,
    /// Set on the owner's mapping until the name is unlinked.
    path: Option<CString>,
}

// SAFETY: the mapping is shared memory accessed through atomics (headers) or under the
// post/ack protocol (data); the pointer itself is never reassigned.
unsafe impl Send for Segment {}
// SAFETY: as above.
unsafe impl Sync for Segment {}

fn io(context: String) -> CommError {
    CommError::Io {
        context,
        source: std::io::Error::last_os_error(),
    }
}

/// The file name of `rank`'s segment in the job with `nonce`.
pub(crate) fn path_of(nonce: &[u8], rank: usize) -> String {
    let hex: String = nonce.iter().map(|b| format!("{b:02x}")).collect();
    format!("/dev/shm/oxiflow-{hex}-{rank}")
}

/// `path` as a C string for `open`.
fn c_path(path: &str) -> Result<CString, CommError> {
    CString::new(path).map_err(|_| CommError::InvalidArgument {
        op: "shm setup".into(),
        detail: format!("segment path {path:?} contains a NUL byte"),
    })
}

impl Segment {
    /// Creates (exclusively) and maps this rank's segment.
    pub fn create(path: &str, world: usize, rank: usize) -> Result<Segment, CommError> {
        let layout = Layout::new(world);
        let c = c_path(path)?;
        // SAFETY: valid C string; flags create a new private (0600) file.
        let fd = unsafe {
            libc::open(
                c.as_ptr(),
                libc::O_RDWR | libc::O_CREAT | libc::O_EXCL | libc::O_CLOEXEC,
                0o600 as libc::c_uint,
            )
        };
        if fd < 0 {
            return Err(io(format!("shm setup: create {path}")));
        }
        // From here on the guard unlinks the name on any failure.
        let mut seg = Segment {
            ptr: std::ptr::null_mut(),
            layout,
            path: Some(c),
        };
        // SAFETY: fd is open; len fits in off_t for any sane world size.
        let rc = unsafe { libc::ftruncate(fd, layout.len as libc::off_t) };
        if rc != 0 {
            let e = io(format!("shm setup: size {path} to {} bytes", layout.len));
            // SAFETY: closing our own fd.
            unsafe { libc::close(fd) };
            return Err(e);
        }
        let mapped = map(fd, layout.len, path);
        // SAFETY: closing our own fd; the mapping keeps the file alive.
        unsafe { libc::close(fd) };
        seg.ptr = mapped?;
        seg.u64_at(0).store(MAGIC, Ordering::Relaxed);
        seg.u64_at(8).store(world as u64, Ordering::Relaxed);
        // SAFETY: getpid has no preconditions.
        seg.u64_at(24)
            .store(unsafe { libc::getpid() } as u64, Ordering::Relaxed);
        seg.u64_at(32).store(seg.ptr as u64, Ordering::Relaxed);
        seg.u64_at(16).store(rank as u64, Ordering::Release);
        Ok(seg)
    }

    /// Maps a peer's segment and checks its header.
    pub fn open(path: &str, world: usize, rank: usize) -> Result<Segment, CommError> {
        let layout = Layout::new(world);
        let c = c_path(path)?;
        // SAFETY: valid C string.
        let fd = unsafe { libc::open(c.as_ptr(), libc::O_RDWR | libc::O_CLOEXEC) };
        if fd < 0 {
            return Err(io(format!("shm setup: open {path}")));
        }
        // SAFETY: fstat into a zeroed struct on an open fd.
        let mut st: libc::stat = unsafe { std::mem::zeroed() };
        // SAFETY: `fd` is open and `st` is a valid, writable stat struct.
        let ok = unsafe { libc::fstat(fd, &mut st) } == 0 && st.st_size as usize == layout.len;
        let mapped = if ok {
            map(fd, layout.len, path)
        } else {
            Err(CommError::Mismatch {
                op: "shm setup".into(),
                detail: format!("{path} has {} bytes, expected {}", st.st_size, layout.len),
            })
        };
        // SAFETY: closing our own fd.
        unsafe { libc::close(fd) };
        let seg = Segment {
            ptr: mapped?,
            layout,
            path: None,
        };
        let (m, w, r) = (
            seg.u64_at(0).load(Ordering::Acquire),
            seg.u64_at(8).load(Ordering::Acquire),
            seg.u64_at(16).load(Ordering::Acquire),
        );
        if m != MAGIC || w != world as u64 || r != rank as u64 {
            return Err(CommError::Mismatch {
                op: "shm setup".into(),
                detail: format!("{path} is not rank {rank}'s segment of a {world}-rank world"),
            });
        }
        Ok(seg)
    }

    /// The owner's process id and the address of this segment in the owner's address space.
    pub fn owner(&self) -> (libc::pid_t, u64) {
        (
            self.u64_at(24).load(Ordering::Relaxed) as libc::pid_t,
            self.u64_at(32).load(Ordering::Relaxed),
        )
    }

    /// Whether this process can read the owner's memory directly (cross-memory attach).
    pub fn probe_cma(&self) -> bool {
        let (pid, addr) = self.owner();
        let mut v = [0u8; 8];
        cma_read(pid, addr, &mut v).is_ok() && u64::from_le_bytes(v) == MAGIC
    }

    /// Removes the name (the memory lives on while mapped); idempotent.
    pub fn unlink(&mut self) {
        if let Some(p) = self.path.take() {
            // SAFETY: valid C string.
            unsafe { libc::unlink(p.as_ptr()) };
        }
    }

    fn u64_at(&self, off: usize) -> &AtomicU64 {
        debug_assert!(off.is_multiple_of(8) && off + 8 <= self.layout.len);
        // SAFETY: in bounds, 8-aligned (the mapping is page-aligned), shared memory that is
        // only accessed atomically at this offset.
        unsafe { &*(self.ptr.add(off) as *const AtomicU64) }
    }

    /// The futex word a waiting owner sleeps on, and the count of sleepers.
    pub fn doorbell(&self) -> (&AtomicU32, &AtomicU32) {
        // SAFETY: in bounds and 4-aligned; accessed atomically only.
        unsafe {
            (
                &*(self.ptr.add(DOORBELL) as *const AtomicU32),
                &*(self.ptr.add(DOORBELL + 4) as *const AtomicU32),
            )
        }
    }

    /// Slot `s`'s post word (tag hash << 8 | phase), then its info words (group, seq, op,
    /// round, check, seal).
    pub fn post(&self, s: usize) -> &AtomicU64 {
        self.u64_at(HEADERS + s * LINE)
    }
    pub fn info(&self, s: usize, i: usize) -> &AtomicU64 {
        self.u64_at(HEADERS + s * LINE + 8 + 8 * i)
    }
    /// What world rank `reader` last consumed from slot `s` (a post word).
    pub fn ack(&self, s: usize, reader: usize) -> &AtomicU64 {
        self.u64_at(ACKS + (s * self.layout.world + reader) * LINE)
    }
    /// Metadata word `k < 4 * world` of slot `s` (piece lengths, for checks; addresses).
    pub fn meta(&self, s: usize, k: usize) -> &AtomicU64 {
        let meta_len = align_up(self.layout.world * META_BYTES, PAGE);
        self.u64_at(self.layout.meta + s * meta_len + 8 * k)
    }
    /// Start of slot `s`'s payload (`SLOT_BYTES`, page-aligned).
    pub fn data(&self, s: usize) -> *mut u8 {
        // SAFETY: the offset is inside the mapping.
        unsafe { self.ptr.add(self.layout.data + s * self.layout.slot_stride) }
    }
}

fn map(fd: libc::c_int, len: usize, path: &str) -> Result<*mut u8, CommError> {
    // SAFETY: mapping `len` bytes of an open file that has that size.
    let p = unsafe {
        libc::mmap(
            std::ptr::null_mut(),
            len,
            libc::PROT_READ | libc::PROT_WRITE,
            libc::MAP_SHARED,
            fd,
            0,
        )
    };
    if p == libc::MAP_FAILED {
        return Err(io(format!("shm setup: map {path}")));
    }
    Ok(p as *mut u8)
}

impl Drop for Segment {
    fn drop(&mut self) {
        self.unlink();
        if !self.ptr.is_null() {
            // SAFETY: unmapping our own mapping of `len` bytes.
            unsafe { libc::munmap(self.ptr as *mut libc::c_void, self.layout.len) };
        }
    }
}

/// Most remote iovecs one process_vm_readv takes (IOV_MAX).
const IOV_MAX: usize = 1024;

/// Copies `dst.len()` bytes at `addr` of process `pid` into `dst` (process_vm_readv).
pub(crate) fn cma_read(pid: libc::pid_t, addr: u64, dst: &mut [u8]) -> std::io::Result<()> {
    cma_read_runs(pid, addr, dst.len(), dst.len(), dst)
}

/// Copies into `dst` the `dst.len()` bytes of process `pid` that are laid out as runs of
/// `run` bytes, `stride` apart, from `addr`: one copy, straight into `dst`, up to `IOV_MAX`
/// runs per system call.
pub(crate) fn cma_read_runs(
    pid: libc::pid_t,
    addr: u64,
    run: usize,
    stride: usize,
    dst: &mut [u8],
) -> std::io::Result<()> {
    if dst.is_empty() {
        return Ok(());
    }
    if run == 0 {
        return Err(std::io::Error::new(
            std::io::ErrorKind::InvalidInput,
            "runs of zero bytes",
        ));
    }
    let mut done = 0;
    let mut remote: Vec<libc::iovec> = Vec::with_capacity(IOV_MAX.min(dst.len().div_ceil(run)));
    while done < dst.len() {
        remote.clear();
        let mut p = done;
        while p < dst.len() && remote.len() < IOV_MAX {
            let (i, o) = (p / run, p % run);
            let l = (run - o).min(dst.len() - p);
            let at = (i as u64)
                .checked_mul(stride as u64)
                .and_then(|x| x.checked_add(addr + o as u64))
                .ok_or_else(|| std::io::Error::other("remote address overflows"))?;
            remote.push(libc::iovec {
                iov_base: at as *mut libc::c_void,
                iov_len: l,
            });
            p += l;
        }
        let local = libc::iovec {
            iov_base: dst[done..].as_mut_ptr() as *mut libc::c_void,
            iov_len: p - done,
        };
        // SAFETY: one local iovec over our own writable buffer (`p - done` bytes of it); the
        // remote ranges are checked by the kernel (an invalid one fails with EFAULT).
        let n = unsafe {
            libc::process_vm_readv(
                pid,
                &local,
                1,
                remote.as_ptr(),
                remote.len() as libc::c_ulong,
                0,
            )
        };
        if n < 0 {
            let e = std::io::Error::last_os_error();
            if e.kind() == std::io::ErrorKind::Interrupted {
                continue;
            }
            return Err(e);
        }
        if n == 0 {
            return Err(std::io::Error::new(
                std::io::ErrorKind::UnexpectedEof,
                "process_vm_readv read nothing",
            ));
        }
        done += n as usize;
    }
    Ok(())
}
