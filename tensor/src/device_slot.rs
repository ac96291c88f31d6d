//! [`DeviceSlot`]: where the implementation of a device type registered at run time (a device
//! backend, an op executor) is kept. Only CUDA's can be registered; the CPU's are built in.

use std::sync::{Arc, RwLock};

use oxiflow_placement::DeviceType;

use crate::storage::Device;
use crate::{Result, TensorError};

/// The registered CUDA implementation of one kind, if any.
pub(crate) struct DeviceSlot<T: ?Sized> {
    cuda: RwLock<Option<Arc<T>>>,
    /// What the slot holds, as a missing one's error names it.
    what: &'static str,
    /// The error detail of registering one for the CPU.
    built_in: &'static str,
}

impl<T: ?Sized> DeviceSlot<T> {
    /// An empty slot of `what`; `built_in` says why a CPU one cannot be registered.
    pub(crate) const fn new(what: &'static str, built_in: &'static str) -> Self {
        DeviceSlot {
            cuda: RwLock::new(None),
            what,
            built_in,
        }
    }

    /// Registers `value` for `device` (a typed error naming `op` for the CPU).
    pub(crate) fn register(
        &self,
        op: &'static str,
        device: DeviceType,
        value: Arc<T>,
    ) -> Result<()> {
        match device {
            DeviceType::Cuda => {
                if let Ok(mut g) = self.cuda.write() {
                    *g = Some(value);
                }
                Ok(())
            }
            DeviceType::Cpu => Err(TensorError::Device {
                op,
                devices: "cpu".into(),
                shapes: String::new(),
                detail: self.built_in.into(),
            }),
        }
    }

    /// The registered CUDA implementation, if any.
    pub(crate) fn cuda(&self) -> Option<Arc<T>> {
        self.cuda.read().ok().and_then(|g| g.clone())
    }

    /// The registered implementation of `device`, or a typed error naming `op`.
    pub(crate) fn of(&self, op: &'static str, device: Device) -> Result<Arc<T>> {
        let found = match device {
            Device::Cpu => None,
            Device::Cuda(_) => self.cuda(),
        };
        found.ok_or_else(|| TensorError::Device {
            op,
            devices: device.to_string(),
            shapes: String::new(),
            detail: format!("no {} registered for {device}", self.what),
        })
    }
}
