//! `DeviceBytes`: an owned device allocation that lends `Buf::Device`/`BufMut::Device` views,
//! for tests, benchmarks and callers that have no tensor storage of their own.

use std::sync::Arc;

use cudarc::driver::{CudaSlice, CudaStream, DevicePtr as _};

use crate::{Buf, BufMut, CommError, DevicePtr};

/// `len` bytes on one device (at least one byte is allocated, so empty buffers are valid).
pub struct DeviceBytes {
    slice: CudaSlice<u8>,
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
            slice,
            stream: stream.clone(),
            len: host.len(),
        })
    }

    /// A zeroed allocation of `len` bytes.
    pub fn zeros(stream: &Arc<CudaStream>, len: usize) -> Result<Self, CommError> {
        let slice = stream
            .alloc_zeros::<u8>(len.max(1))
            .map_err(|e| err("device buffer allocation", e))?;
        Ok(DeviceBytes {
            slice,
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
        self.slice.device_ptr(&self.stream).0
    }

    pub fn device(&self) -> usize {
        self.stream.context().ordinal()
    }

    /// Copies the contents back (waits for the stream's queued work first).
    pub fn to_host(&self) -> Result<Vec<u8>, CommError> {
        let mut v = self
            .stream
            .clone_dtoh(&self.slice)
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
