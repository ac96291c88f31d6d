//! Buffers a collective reads and writes: host bytes now, device memory through `DevicePtr`.

use std::marker::PhantomData;

/// A region of device memory, borrowed for the duration of one call. Built by the tensor
/// layer from memory it owns; the communicator only passes the pointer to its device library.
#[derive(Clone, Copy, Debug)]
pub struct DevicePtr<'a> {
    /// Raw device address (e.g. a CUdeviceptr).
    pub ptr: u64,
    /// Length in bytes.
    pub bytes: usize,
    /// Device ordinal the memory lives on.
    pub device: usize,
    _borrow: PhantomData<&'a mut [u8]>,
}

impl DevicePtr<'_> {
    /// # Safety
    /// `ptr` must point to `bytes` bytes of device memory on `device` that stay valid (and, for
    /// writes, unaliased) for the borrow's lifetime.
    pub unsafe fn new(ptr: u64, bytes: usize, device: usize) -> Self {
        DevicePtr {
            ptr,
            bytes,
            device,
            _borrow: PhantomData,
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

impl Buf<'_> {
    pub fn len_bytes(&self) -> usize {
        match self {
            Buf::Host(b) => b.len(),
            Buf::Device(d) => d.bytes,
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
