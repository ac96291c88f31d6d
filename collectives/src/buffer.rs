//! Buffers a collective reads and writes: host bytes now, device memory through `DevicePtr`.

use std::marker::PhantomData;
use std::sync::Arc;

use cudarc::driver::CudaEvent;

/// The owner of a device buffer, ordering its own later uses after a collective. A device
/// communicator that finds a fence on every buffer of a call does not make the caller's stream
/// wait for the call; it hands each fence the event that completes with the call instead, and
/// the owner makes its stream wait for that event before it next reads, writes or frees the
/// memory. Buffers without a fence keep the eager order (the caller's stream waits at once).
pub trait DeviceFence: Send + Sync {
    /// `done` completes when the collective that read or wrote this memory has finished.
    fn after_collective(&self, done: &Arc<CudaEvent>);
    /// `done` completes when a point-to-point send from this memory has been received, which
    /// waits for the receiver to post its receive: no stream of the owner may wait for it (the
    /// receiver may be waiting for this rank's later work, a cycle), so the owner leaves the
    /// memory untouched and reuses it only once `done` has completed. The default treats it
    /// as a collective's end.
    fn after_send(&self, done: &Arc<CudaEvent>) {
        self.after_collective(done)
    }
}

/// A region of device memory, borrowed for the duration of one call. Built by the tensor
/// layer from memory it owns; the communicator only passes the pointer to its device library.
#[derive(Clone, Copy)]
pub struct DevicePtr<'a> {
    /// Raw device address (e.g. a CUdeviceptr).
    pub ptr: u64,
    /// Length in bytes.
    pub bytes: usize,
    /// Device ordinal the memory lives on.
    pub device: usize,
    /// Where the end of a collective on this memory is reported (see [`DeviceFence`]).
    pub fence: Option<&'a dyn DeviceFence>,
    _borrow: PhantomData<&'a mut [u8]>,
}

impl std::fmt::Debug for DevicePtr<'_> {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("DevicePtr")
            .field("ptr", &format_args!("{:#x}", self.ptr))
            .field("bytes", &self.bytes)
            .field("device", &self.device)
            .field("fenced", &self.fence.is_some())
            .finish()
    }
}

impl<'a> DevicePtr<'a> {
    /// # Safety
    /// `ptr` must point to `bytes` bytes of device memory on `device` that stay valid (and, for
    /// writes, unaliased) for the borrow's lifetime.
    pub unsafe fn new(ptr: u64, bytes: usize, device: usize) -> Self {
        DevicePtr {
            ptr,
            bytes,
            device,
            fence: None,
            _borrow: PhantomData,
        }
    }

    /// The same region, with the owner's fence: a collective on it reports its end there
    /// instead of making the caller's stream wait.
    pub fn with_fence(self, fence: &'a dyn DeviceFence) -> Self {
        DevicePtr {
            fence: Some(fence),
            ..self
        }
    }
}

/// A buffer a collective reads.
#[derive(Clone, Copy, Debug)]
pub enum Buf<'a> {
    Host(&'a [u8]),
    Device(DevicePtr<'a>),
}

/// A buffer a collective writes.
#[derive(Debug)]
pub enum BufMut<'a> {
    Host(&'a mut [u8]),
    Device(DevicePtr<'a>),
}

impl DevicePtr<'_> {
    /// Bytes `range` of this region (None when outside it); same device and fence.
    fn slice(&self, range: std::ops::Range<usize>) -> Option<Self> {
        (range.start <= range.end && range.end <= self.bytes).then_some(DevicePtr {
            ptr: self.ptr + range.start as u64,
            bytes: range.end - range.start,
            ..*self
        })
    }
}

impl<'a> Buf<'a> {
    pub fn len_bytes(&self) -> usize {
        match self {
            Buf::Host(b) => b.len(),
            Buf::Device(d) => d.bytes,
        }
    }
    /// Bytes `range` of the buffer (None when outside it).
    pub fn slice(&self, range: std::ops::Range<usize>) -> Option<Buf<'a>> {
        match self {
            Buf::Host(b) => b.get(range).map(Buf::Host),
            Buf::Device(d) => d.slice(range).map(Buf::Device),
        }
    }
}

impl BufMut<'_> {
    pub fn len_bytes(&self) -> usize {
        match self {
            BufMut::Host(b) => b.len(),
            BufMut::Device(d) => d.bytes,
        }
    }
    /// Reborrows for a shorter call.
    pub fn reborrow(&mut self) -> BufMut<'_> {
        match self {
            BufMut::Host(b) => BufMut::Host(b),
            BufMut::Device(d) => BufMut::Device(*d),
        }
    }
    /// Bytes `range` of the buffer, for a shorter call (None when outside it).
    pub fn slice_mut(&mut self, range: std::ops::Range<usize>) -> Option<BufMut<'_>> {
        match self {
            BufMut::Host(b) => b.get_mut(range).map(BufMut::Host),
            BufMut::Device(d) => d.slice(range).map(BufMut::Device),
        }
    }
    /// A read view of the same memory.
    pub fn as_buf(&self) -> Buf<'_> {
        match self {
            BufMut::Host(b) => Buf::Host(b),
            BufMut::Device(d) => Buf::Device(*d),
        }
    }
}

impl<'a> From<&'a [u8]> for Buf<'a> {
    fn from(b: &'a [u8]) -> Self {
        Buf::Host(b)
    }
}
impl<'a> From<&'a mut [u8]> for BufMut<'a> {
    fn from(b: &'a mut [u8]) -> Self {
        BufMut::Host(b)
    }
}
