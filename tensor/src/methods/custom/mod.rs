//! The `Tensor` methods of the custom ops (`op/custom/`), one file per op.

mod classifier;
mod fused_elementwise;
mod linear;
mod linear_classifier;
mod residual_mlp;
