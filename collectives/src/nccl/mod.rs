//! The NCCL backend: `NcclComm` (the `Communicator` on CUDA device buffers), NCCL bound from the
//! library `cuda_libs` finds, and the id exchange through the rendezvous store.

mod comm;
mod devbuf;
mod exchange;
pub mod ffi;

pub use comm::{Completion, NcclComm, NcclOptions};
pub use devbuf::DeviceBytes;
pub use exchange::{FileExchange, IdExchange};
