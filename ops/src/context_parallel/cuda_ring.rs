//! The ring's exchanges on device memory: each step's grouped send/receive posted through the
//! members' `Peers` with fenced buffers, so the compute stream waits for an arrival only where it
//! reads it, and for every exchange before the call returns.

use std::sync::{Arc, Mutex, PoisonError};

use cudarc::driver::CudaEvent;
use oxiflow_collectives::{DeviceFence, DevicePtr};
use oxiflow_cuda::{device_error, CudaRuntime};
use oxiflow_dtype::DType;
use oxiflow_tensor::{Peers, Result};

/// Where a ring exchange reports its end: the events the compute stream waits for before it
/// reads what arrived (or frees what was sent).
#[derive(Default)]
struct Arrival(Mutex<Vec<Arc<CudaEvent>>>);

impl DeviceFence for Arrival {
    fn after_collective(&self, done: &Arc<CudaEvent>) {
        self.0
            .lock()
            .unwrap_or_else(PoisonError::into_inner)
            .push(done.clone());
    }
}

/// The exchanges a call has posted: the compute stream waits for every one before the call
/// returns (its scratch is freed on that stream), on every path out.
pub(super) struct Ring<'a> {
    rt: &'a Arc<CudaRuntime>,
    name: &'static str,
    posted: Vec<Arc<CudaEvent>>,
}

impl<'a> Ring<'a> {
    /// A call's ring on `rt`, its errors naming `name`.
    pub(super) fn new(rt: &'a Arc<CudaRuntime>, name: &'static str) -> Ring<'a> {
        Ring {
            rt,
            name,
            posted: Vec::new(),
        }
    }

    /// Posts one ring step: `send` (address, bytes) to the next member, `recv` from the
    /// previous, elements of `dt`; returns the step's end events.
    pub(super) fn shift(
        &mut self,
        peers: &Peers,
        dt: DType,
        send: (u64, usize),
        recv: (u64, usize),
    ) -> Result<Vec<Arc<CudaEvent>>> {
        let fence = Arrival::default();
        let dev = self.rt.ordinal();
        // SAFETY: both regions lie in buffers this call holds (its inputs or the executor's
        // scratch) until the compute stream has waited for the exchange's end, which `Ring`
        // makes it do before the call returns; nothing else writes the receiving region
        // meanwhile (each step receives into a region of its own).
        let (s, r) = unsafe {
            (
                DevicePtr::new(send.0, send.1, dev),
                DevicePtr::new(recv.0, recv.1, dev),
            )
        };
        let sent = peers.shift_device(self.name, dt, s.with_fence(&fence), r.with_fence(&fence));
        let events = std::mem::take(&mut *fence.0.lock().unwrap_or_else(PoisonError::into_inner));
        self.posted.extend(events.iter().cloned());
        sent?;
        Ok(events)
    }

    /// Makes the compute stream wait for `events` (drained).
    pub(super) fn wait(&self, events: &mut Vec<Arc<CudaEvent>>) -> Result<()> {
        for e in events.drain(..) {
            self.rt
                .stream()
                .wait(&e)
                .map_err(|e| device_error(self.name, format!("waiting for the ring: {e}")))?;
        }
        Ok(())
    }
}

impl Drop for Ring<'_> {
    fn drop(&mut self) {
        let mut posted = std::mem::take(&mut self.posted);
        // An error has already been returned where this fails; the waits still order every
        // exchange that did start before the scratch is freed.
        let _ = self.wait(&mut posted);
    }
}
