//! OxiFlow, the facade users import: global tensors with placements and SBP, the models built on
//! them (`nn`, `optim`, `checkpoint`), and the crates underneath (placement, sbp, boxing,
//! collectives, tensor, models) as modules.
//!
//! ```text
//! use oxiflow::prelude::*;
//! oxiflow::init_from_env()?;
//! let p = Placement::new_1d(DeviceType::Cpu, [0, 1])?;
//! let y = x.to_global(&p, Sbp::S(0))?.matmul(&w)?;
//! ```

pub use oxiflow_boxing as boxing;
pub use oxiflow_collectives as collectives;
pub use oxiflow_models as models;
pub use oxiflow_placement as placement;
pub use oxiflow_sbp as sbp;
pub use oxiflow_tensor as tensor;

pub use oxiflow_models::{checkpoint, nn, optim};
pub use oxiflow_tensor::*;

/// The names most programs need.
pub mod prelude {
    pub use oxiflow_collectives::DType;
    pub use oxiflow_placement::{DeviceType, Placement};
    pub use oxiflow_sbp::{NdSbp, ReduceOp, Sbp, Shape};
    pub use oxiflow_tensor::{Tensor, TensorError};
}
