//! Pipeline parallelism as placements: each stage of a mesh `[pp, dp, tp]` is the `[dp, tp]`
//! sub-placement at `pp = s` and holds its chunks of blocks (`nn::gpt::StageSplit`); schedules
//! (GPipe, 1F1B, interleaved 1F1B) are per-stage action lists (`schedule`), and `runner` runs a
//! rank's list on any `PipelineModel` (`Gpt` is one), moving streams and gradients between stages with `to_global`.

mod gpt;
mod model;
mod runner;
mod schedule;
mod streams;

pub use model::{PipelineModel, Tied};
pub use runner::{run_step, MicroBatches, StepReport};
pub use schedule::{Action, HostOp, Message, PipelineSpec, Schedule};
pub use streams::{ReplayReport, Transport};
