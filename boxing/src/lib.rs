//! Boxing: plans a transition between (placement, nd-SBP) layouts of one global shape and
//! dtype as steps (per-axis collectives, local slice/zero, point-to-point moves of slice
//! intersections, device copies), caches plans, and executes them on a rank's local piece.

mod error;
mod execute;
mod piece;
mod plan;
pub mod region;
mod search;
mod strategy;

pub use error::BoxingError;
pub use execute::{boxing, check, execute};
pub use piece::{Fill, HostData, HostPiece, LocalPiece};
pub use plan::{
    build_plan, build_plan_with, validate, BoxingPlanner, Plan, Step, StepKind, Strategy,
};
pub use strategy::p2p_intersections::{P2pPlan, RankIo, Transfer};
