//! `DeviceBytes`: an owned device allocation that lends `Buf::Device`/`BufMut::Device` views,
//! for tests, benchmarks and callers that have no tensor storage of their own; from the
//! driver's allocator, or from NCCL's (`NcclMemory`, registered by the collectives that use it).

use std::sync::Arc;

use cudarc::driver::{CudaSlice, CudaStream, DevicePtr as _};

use super::comm::NcclMemory;
use crate::{Buf, BufMut, CommError, DevicePtr};

/// Where the bytes live.
enum Storage {
    Driver(CudaSlice<u8>),
    /// Freed after the stream's queued work (`NcclMemory` is not freed in stream order).
    Nccl(NcclMemory),
}

/// `len` bytes on one device (at least one byte is allocated, so empty buffers are valid).
pub struct DeviceBytes {
    storage: Storage,
    stream: Arc<CudaStream>,
    len: usize,
}

fn err(op: &str, e: impl std::fmt::Display) -> CommError {
    CommError::Device(format!("{op}: CUDA driver: {e}"))
}

impl DeviceBytes {
    /// Copies `host` to a new allocation, queued on `stream`.
    pub fn from_host(stream: &Arc<CudaStream>, host: &[u8]) -> Result<Self, CommError> {
        let slice = if host.is_empty() {
            stream.alloc_zeros::<u8>(1)
        } else {
            stream.clone_htod(host)
        }
        .map_err(|e| err("device buffer upload", e))?;
        Ok(DeviceBytes {
            storage: Storage::Driver(slice),
            stream: stream.clone(),
            len: host.len(),
        })
    }

    /// `from_host` into memory from NCCL's allocator.
    pub fn from_host_nccl(stream: &Arc<CudaStream>, host: &[u8]) -> Result<Self, CommError> {
        let b = Self::zeros_nccl(stream, host.len())?;
        if !host.is_empty() {
            // SAFETY: the allocation holds at least host.len() bytes; the host slice outlives
            // the copy, which the synchronize below waits for.
            unsafe { cudarc::driver::result::memcpy_htod_async(b.ptr(), host, stream.cu_stream()) }
                .and_then(|_| stream.synchronize())
                .map_err(|e| err("device buffer upload", e))?;
        }
        Ok(b)
    }

    /// `zeros` in memory from NCCL's allocator.
    pub fn zeros_nccl(stream: &Arc<CudaStream>, len: usize) -> Result<Self, CommError> {
        stream
            .context()
            .bind_to_thread()
            .map_err(|e| err("device buffer allocation", e))?;
        let m = NcclMemory::alloc(len.max(1))?;
        // SAFETY: sets the allocation's own bytes, on the stream that owns it.
        unsafe {
            cudarc::driver::result::memset_d8_async(m.ptr(), 0, len.max(1), stream.cu_stream())
        }
        .map_err(|e| err("device buffer allocation", e))?;
        Ok(DeviceBytes {
            storage: Storage::Nccl(m),
            stream: stream.clone(),
            len,
        })
    }

    /// A zeroed allocation of `len` bytes.
    pub fn zeros(stream: &Arc<CudaStream>, len: usize) -> Result<Self, CommError> {
        let slice = stream
            .alloc_zeros::<u8>(len.max(1))
            .map_err(|e| err("device buffer allocation", e))?;
        Ok(DeviceBytes {
            storage: Storage::Driver(slice),
            stream: stream.clone(),
            len,
        })
    }

    pub fn len(&self) -> usize {
        self.len
    }
    pub fn is_empty(&self) -> bool {
        self.len == 0
    }

    /// The raw device address.
    pub fn ptr(&self) -> u64 {
        match &self.storage {
            Storage::Driver(s) => s.device_ptr(&self.stream).0,
            Storage::Nccl(m) => m.ptr(),
        }
    }

    pub fn device(&self) -> usize {
        self.stream.context().ordinal()
    }

    /// Copies the contents back (waits for the stream's queued work first).
    pub fn to_host(&self) -> Result<Vec<u8>, CommError> {
        let mut v = match &self.storage {
            Storage::Driver(s) => self.stream.clone_dtoh(s).map_err(|e| e.to_string()),
            Storage::Nccl(m) => {
                let mut v = vec![0u8; self.len];
                // SAFETY: the allocation holds `len` bytes; the synchronize below waits for
                // the copy before `v` is read or dropped.
                unsafe {
                    cudarc::driver::result::memcpy_dtoh_async(
                        &mut v,
                        m.ptr(),
                        self.stream.cu_stream(),
                    )
                }
                .and_then(|_| self.stream.synchronize())
                .map(|_| v)
                .map_err(|e| e.to_string())
            }
        }
        .map_err(|e| err("device buffer download", e))?;
        v.truncate(self.len);
        Ok(v)
    }

    pub fn as_buf(&self) -> Buf<'_> {
        // SAFETY: the allocation outlives the borrow and has `len` valid bytes.
        Buf::Device(unsafe { DevicePtr::new(self.ptr(), self.len, self.device()) })
    }

    pub fn as_buf_mut(&mut self) -> BufMut<'_> {
        // SAFETY: exclusive borrow of an allocation with `len` valid bytes.
        BufMut::Device(unsafe { DevicePtr::new(self.ptr(), self.len, self.device()) })
    }
}

impl Drop for DeviceBytes {
    fn drop(&mut self) {
        if matches!(self.storage, Storage::Nccl(_)) {
            // NCCL memory is unmapped at once: the stream's work on it must be done.
            let _ = self.stream.synchronize();
        }
    }
}
