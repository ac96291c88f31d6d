//! The SBP algebra: shapes, `Sbp`/`NdSbp`, the balanced splitter, global layouts (which piece of
//! the global index space each rank holds), and signature inference for ops.

mod error;
mod layout;
mod nd_sbp;
mod sbp;
mod shape;
mod splitter;

pub use error::SbpError;
pub use layout::{check_nd_sbp, GlobalLayout, Region};
pub use nd_sbp::NdSbp;
pub use sbp::{ReduceOp, Sbp};
pub use shape::Shape;
pub use splitter::BalancedSplitter;
