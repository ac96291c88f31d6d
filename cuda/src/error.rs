//! The CUDA backend's device errors: a typed `TensorError::Device` naming the op, also for a
//! failed kernel launch.

use oxiflow_tensor::TensorError;

/// A typed device error naming `op` (what a CUDA kernel reports a launch failure as).
pub fn device_error(op: &'static str, detail: impl std::fmt::Display) -> TensorError {
    derr(op, detail)
}

/// A kernel launch's outcome (`launch` as cudarc returns it): a failure is a typed device error
/// naming `op`.
pub fn launched<T>(
    op: &'static str,
    launch: std::result::Result<T, cudarc::driver::DriverError>,
) -> oxiflow_tensor::Result<()> {
    launch
        .map(|_| ())
        .map_err(|e| derr(op, format!("launch: {e}")))
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
