//! The NCCL backend: `NcclComm` (the `Communicator` on CUDA device buffers), NCCL bound from the
//! library `cuda_libs` finds, and the id exchange through the rendezvous store.

mod comm;
mod devbuf;
mod exchange;
pub mod ffi;
mod launch;

pub use comm::{Completion, NcclComm, NcclMemory, NcclOptions};
pub use devbuf::DeviceBytes;
pub use exchange::{FileExchange, IdExchange};
pub use launch::{init_world, init_world_nccl, nccl_unavailable};
