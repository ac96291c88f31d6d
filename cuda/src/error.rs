//! The CUDA backend's device errors: a typed `TensorError::Device` naming the op.

use oxiflow_tensor::TensorError;

/// A typed device error naming `op` (what a CUDA kernel reports a launch failure as).
pub fn device_error(op: &'static str, detail: impl std::fmt::Display) -> TensorError {
    derr(op, detail)
}

/// A typed device error naming `op`.
pub(crate) fn derr(op: &'static str, detail: impl std::fmt::Display) -> TensorError {
    TensorError::Device {
        op,
        devices: "cuda".into(),
        shapes: String::new(),
        detail: detail.to_string(),
    }
}
