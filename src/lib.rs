//! OxiFlow, the facade users import: the tensor crate's items at the root (global tensors with
//! placements and SBP), the models built on them as modules (`nn`, `optim`, `checkpoint`,
//! `data`, `pipeline`, `footprint`), the training loop (`trainer`), the CUDA backend (`cuda`,
//! whose `init_from_env` is the root's: it registers the NCCL world's CUDA binding), and the
//! crates underneath the tensor crate (dtype, placement, sbp, boxing, collectives) as modules.
//! Each item has one path here (plus `prelude`).
//!
//! ```text
//! use oxiflow::prelude::*;
//! oxiflow::init_from_env()?;
//! let p = Placement::new_1d(DeviceType::Cpu, [0, 1])?;
//! let y = x.to_global(&p, Sbp::S(0))?.matmul(&w)?;
//! ```
//!
//! The README's code blocks are compiled as doc tests of the `readme` module.

pub use oxiflow_boxing as boxing;
pub use oxiflow_collectives as collectives;
pub use oxiflow_compile as compile;
pub use oxiflow_cuda as cuda;
pub use oxiflow_dtype as dtype;
pub use oxiflow_placement as placement;
pub use oxiflow_sbp as sbp;
pub use oxiflow_trainer as trainer;

pub use oxiflow_models::{checkpoint, data, footprint, nn, optim, pipeline};
pub use oxiflow_tensor::*;
// Process start-up with the CUDA backend registered (shadows the core's CPU-and-registered-only
// start-up of the glob above).
// A program that binds CUDA waits for the device's start-up builds before it exits.
pub use oxiflow_cuda::{finish_background_builds, init_from_env, init_with_env};

/// Any error of the crates underneath, so a program can use `?` on all of them (boxed, so a
/// `Result` stays small). Its `Debug` form is its message, so `fn main() -> Result<(),
/// oxiflow::Error>` reports a failure as one readable line.
#[derive(thiserror::Error)]
pub enum Error {
    #[error(transparent)]
    Tensor(Box<oxiflow_tensor::TensorError>),
    #[error(transparent)]
    Placement(Box<oxiflow_placement::PlacementError>),
    #[error(transparent)]
    Sbp(Box<oxiflow_sbp::SbpError>),
    #[error(transparent)]
    Boxing(Box<oxiflow_boxing::BoxingError>),
    #[error(transparent)]
    Comm(Box<oxiflow_collectives::CommError>),
    /// A program's own check failed (e.g. it needs more ranks than it was started with).
    #[error("{0}")]
    Program(String),
}

macro_rules! from_boxed {
    ($($variant:ident: $ty:ty),*) => {
        $(impl From<$ty> for Error {
            fn from(e: $ty) -> Error {
                Error::$variant(Box::new(e))
            }
        })*
    };
}

from_boxed!(
    Tensor: oxiflow_tensor::TensorError,
    Placement: oxiflow_placement::PlacementError,
    Sbp: oxiflow_sbp::SbpError,
    Boxing: oxiflow_boxing::BoxingError,
    Comm: oxiflow_collectives::CommError
);

impl std::fmt::Debug for Error {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        std::fmt::Display::fmt(self, f)
    }
}

/// The names most programs need.
pub mod prelude {
    pub use oxiflow_dtype::{bf16, f16, DType};
    pub use oxiflow_placement::{DeviceType, Placement};
    pub use oxiflow_sbp::{NdSbp, ReduceOp, Sbp, Shape};
    pub use oxiflow_tensor::{Tensor, TensorError};
}

/// The README, whose Rust code blocks run as doc tests (those that need a launcher are
/// `no_run`: they are compiled only).
#[doc = include_str!("../README.md")]
pub mod readme {}
