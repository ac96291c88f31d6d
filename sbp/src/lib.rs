//! The SBP algebra: shapes, `Sbp`/`NdSbp`, the balanced splitter, global layouts (which piece of
//! the global index space each rank holds; `RuntimeSplit` for a split whose sizes are data),
//! the byte cost model of transitions, and signature inference for ops.

pub mod cost;
mod error;
pub mod infer;
mod layout;
mod nd_sbp;
mod runtime_split;
mod sbp;
mod shape;
mod splitter;

pub use cost::{axis_group_bytes, inference_cost, transition_cost, transition_cost_1d};
pub use error::SbpError;
pub use infer::{rules, BinaryOp, InferEngine, ReduceKind, RuleMode, Rules, Signature};
pub use layout::{check_nd_sbp, GlobalLayout, Region};
pub use nd_sbp::NdSbp;
pub use runtime_split::RuntimeSplit;
pub use sbp::{ReduceOp, Sbp};
pub use shape::Shape;
pub use splitter::BalancedSplitter;
