//! Layers: parameters and their registry, `Linear` (replicated, column- or row-parallel on a
//! tensor-parallel mesh axis), `Embedding`, `LayerNorm`, `RmsNorm`, an `Mlp` block, LoRA adapters
//! (`Lora`) and the decoder family (`gpt`).
//!
//! With global view a parallel layer is an ordinary layer whose parameters have chosen nd-SBPs:
//! a column-parallel weight `[in, out]` is `S(1)` on the tensor-parallel axis, a row-parallel one
//! `S(0)`; signature inference and boxing do the rest. Initial values come from the
//! counter-based RNG keyed by (seed, parameter name), so they do not depend on the layout.

mod embedding;
pub mod gpt;
mod init;
mod layer_norm;
mod linear;
mod lora;
mod mlp;
mod param;
mod pass;
mod rms_norm;

pub use embedding::Embedding;
pub use init::{param_seed, Init, ParamPlacement};
pub use layer_norm::LayerNorm;
pub use linear::{Linear, LinearOptions, Parallel};
pub use lora::{Lora, LoraOptions, LoraSite};
pub use mlp::{Activation, Mlp};
pub use param::{Module, ParamRegistry, Parameter};
pub use pass::Pass;
pub use rms_norm::RmsNorm;
