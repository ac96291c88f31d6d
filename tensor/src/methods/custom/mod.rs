//! The `Tensor` methods of the custom ops (`op/custom/`), one file per op.

mod classifier;
mod flash_attention;
mod fused_elementwise;
mod linear;
mod linear_classifier;
mod residual_mlp;
