//! Reads of a tensor's value to the host that overlap the device's later work:
//! [`Tensor::start_read`] queues the copy behind the work queued so far and returns at once;
//! [`PendingRead::wait`] waits for that work and the copy only, so work queued in between (the
//! next decoding step, say) runs meanwhile.

use std::marker::PhantomData;

use oxiflow_sbp::Shape;

use crate::capture::refuse_host_read;
use crate::element::TensorElement;
use crate::storage::{CpuArray, HostRead, ReadDone, Storage};
use crate::tensor::Tensor;
use crate::{Result, TensorError};

/// A read of a tensor's whole value to the host, started by [`Tensor::start_read`].
pub struct PendingRead<T> {
    read: Box<dyn HostRead>,
    shape: Shape,
    _element: PhantomData<T>,
}

impl<T: TensorElement> PendingRead<T> {
    /// The value as a row-major vector, once the device work queued before the read started
    /// and the copy are done.
    pub fn wait(self) -> Result<Vec<T>> {
        let host = self.read.wait()?;
        let dt = host.dtype();
        let a = T::unwrap(host).ok_or_else(|| TensorError::DType {
            op: "start_read",
            dtypes: dt.to_string(),
            shapes: self.shape.to_string(),
            sbps: "-".into(),
            detail: format!("asked for {}", T::DTYPE),
        })?;
        Ok(a.into_raw_vec_and_offset().0)
    }
}

impl Tensor {
    /// Starts reading the whole value to the host (see `to_vec`; a global tensor is boxed to
    /// all-B on its placement first, so every rank of the placement must call it): the copy
    /// is queued behind the work queued so far and this returns at once. Host pieces are read
    /// now. A typed error, before any communication, for an element type other than the
    /// tensor's, a rank outside the placement, or a read inside a compiled step's capture.
    pub fn start_read<T: TensorElement>(&self) -> Result<PendingRead<T>> {
        refuse_host_read("start_read", self)?;
        if T::DTYPE != self.dtype() {
            return Err(TensorError::DType {
                op: "start_read",
                dtypes: self.dtype().to_string(),
                shapes: self.shape().to_string(),
                sbps: self.nd_sbp().map_or("-".into(), |s| s.to_string()),
                detail: format!("asked for {}", T::DTYPE),
            });
        }
        let whole = self.whole_here("start_read")?;
        let read: Box<dyn HostRead> = match whole.storage() {
            Some(Storage::Device(d)) => d.start_host_read()?,
            Some(Storage::Cpu(a)) => Box::new(ReadDone(a.clone())),
            None => Box::new(ReadDone(CpuArray::zeros(
                whole.dtype(),
                whole.local_shape().dims(),
            ))),
        };
        Ok(PendingRead {
            read,
            shape: self.shape().clone(),
            _element: PhantomData,
        })
    }
}
