//! The `Tensor` methods of the custom ops (`op/custom/`), one file per op.

mod fused_elementwise;
