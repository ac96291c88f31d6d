//! Models on OxiFlow's global tensors, above the engine (`oxiflow-tensor`): layers and their
//! parameter registry (`nn`), optimizers whose state lives in each parameter's layout (`optim`),
//! and checkpoints that save any layout and load into any other (`checkpoint`).
//!
//! `nn` and `optim` know nothing of checkpoints; `checkpoint` saves parameters and optimizer
//! state through their public interfaces, so the three modules form no cycle.

pub mod checkpoint;
pub mod nn;
pub mod optim;

pub use oxiflow_tensor::{Result, TensorError};
