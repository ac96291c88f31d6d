//! Boxing: plans a transition between (placement, nd-SBP) layouts of one global shape and
//! dtype as steps (per-axis collectives, local slice/zero, point-to-point moves of slice
//! intersections, device copies), caches plans, and executes them on a rank's local piece.
//!
//! ```text
//! let planner = BoxingPlanner::new();                    // one per process, shared
//! let plan = planner.plan(&from, &to, DType::F32)?;      // pure, cached, same on every rank
//! println!("{}", plan.explain());
//! let out = execute(&plan, &world, my_piece)?;           // Option<P> in, Option<P> out
//! ```
//!
//! Planning: on one placement, a Dijkstra search over nd-SBP states whose edges are valid
//! single-axis steps (docs/design.md's 1-d table on the axis groups, priced with
//! `sbp::transition_cost_1d` on the group tensor), compared with the point-to-point plan; the
//! cheaper wins, ties to the collectives. Across placements or rank sets: point-to-point.
//! Across device types: a device copy first (to CUDA) or last (from CUDA).

mod comm;
mod error;
mod execute;
mod piece;
mod piece_bytes;
mod plan;
pub mod region;
mod search;
mod step;
mod strategy;

pub use error::BoxingError;
pub use execute::{boxing, check, execute, open_one_way};
pub use piece::{Fill, HostData, HostPiece, LocalPiece};
pub use piece_bytes::{
    check_same_dtype, copy_box_bytes, copy_bytes, pack_bytes, unpack_bytes, HostBytes,
};
pub use plan::{build_plan, build_plan_with, validate, BoxingPlanner, Plan, Strategy};
pub use step::{P2pPlan, RankIo, Step, StepKind, Transfer};
