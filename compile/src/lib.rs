//! Compiled training steps. A step closure runs once eagerly under a capturing recorder (the
//! tensor crate's capture seam), which records what dispatch ran on this rank: every global op
//! with the signature inference chose and the rank's lowering of it (local op, output
//! buffers), every boxing plan, through forward, backward and the optimizer update, as a
//! small in-memory program ([`ir`]). Each rank records and lowers its own program; they agree
//! on every collective because dispatch decides signatures and boxing deterministically.
//! Passes ([`passes`]): dead-code elimination (never of a communicating node), liveness with
//! the captured order fixed, and memory planning into one arena per rank. [`CompiledStep`]
//! caches programs by the inputs' shapes, dtypes and layouts, replays them ([`replay`]) and
//! compiles again, naming what changed, when they change. A step that reads a device value on
//! the host is refused with [`CompileError::HostRead`] naming the read, on every rank alike.
//!
//! The replay runs on the executor seam with every buffer the program writes at its planned
//! offset in one arena per program and rank (`oxiflow_tensor::arena`), allocated by the first
//! replay and reused by every later one: kernels write their placed outputs, views are views of
//! the arena's bytes. The offsets are fixed per program, the same on every replay, which is what
//! a CUDA graph captured from one replay needs: on CUDA, from the second replay on, each replay
//! launches one graph captured from a replay (`graph.rs`), and falls back to replaying launch by
//! launch, saying why, where it cannot.

mod error;
mod explain;
mod graph;
pub mod ir;
pub mod passes;
mod recorder;
mod replay;
mod step;

pub use error::{CompileError, Result};
pub use explain::explain;
pub use ir::{Program, StepKey};
pub use replay::{arena_device, replay};
pub use step::{CompileReport, Compiled, CompiledStep, ReplayCounts, StepRun};
