//! Collectives: the `Communicator` interface every backend implements (in-process threads, TCP
//! processes, NCCL), the gRPC rendezvous store, and launch-environment discovery.

mod algorithms;
mod boundary;
mod buffer;
mod call;
mod communicator;
pub mod cuda_libs;
pub mod device_trace;
pub mod env;
mod error;
mod exchanged;
pub mod flight;
pub mod heartbeat;
mod hooks;
pub mod inprocess;
#[cfg(feature = "mpi")]
pub mod mpi;
pub mod nccl;
mod reduce;
pub mod rendezvous;
mod shm;
mod strided;
pub mod tcp;
pub mod trace;
mod widen;

pub use buffer::{Buf, BufMut, DeviceFence, DevicePtr};
pub use communicator::{Backend, Communicator, SharedComm};
pub use error::CommError;
pub use flight::{
    flight_recorder, FlightCall, FlightDump, FlightEntry, FlightRecorder, FlightState, FlightTicket,
};
pub use inprocess::{InProcessComm, InProcessWorld};
pub use oxiflow_dtype::{DType, Element};
pub use reduce::{reduce_into, ReduceOp};
pub use shm::job_segment_paths;
#[doc(hidden)]
pub use shm::wire as shm_wire;
pub use strided::StridedBlock;
pub use tcp::{init_world, TcpComm};
