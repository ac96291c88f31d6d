//! Models on OxiFlow's global tensors, above the engine (`oxiflow-tensor`): layers and their
//! parameter registry (`nn`), optimizers whose state lives in each parameter's layout (`optim`),
//! checkpoints that save any layout and load into any other (`checkpoint`), the bytes of
//! training state per rank (`footprint`), pipeline stages and schedules (`pipeline`), and text data for language models (`data`:
//! tokenizer, corpora, deterministic sharded batches); Hugging Face model directories in and
//! out of the decoder family (`hf`).
//!
//! `nn` and `optim` know nothing of checkpoints; `checkpoint` saves parameters and optimizer
//! state through their public interfaces, so the three modules form no cycle.

pub mod checkpoint;
pub mod data;
pub mod footprint;
pub mod hf;
pub mod nn;
pub mod optim;
pub mod pipeline;
mod shape_error;

pub use oxiflow_tensor::{Result, TensorError};
