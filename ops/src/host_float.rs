//! `HostFloat`: a float element type of the CPU kernels and the type they compute it in (f32
//! for f32 and bf16, f64 for f64): widened once on reading, rounded once on writing.

use half::bf16;
use oxiflow_tensor::TensorElement;

/// A float element type and the type its CPU kernels compute in.
pub(crate) trait HostFloat: TensorElement + Send + Sync {
    type W: Copy + Send + Sync;
    fn widen(self) -> Self::W;
    fn narrow(w: Self::W) -> Self;
}

impl HostFloat for f32 {
    type W = f32;
    fn widen(self) -> f32 {
        self
    }
    fn narrow(w: f32) -> f32 {
        w
    }
}

impl HostFloat for f64 {
    type W = f64;
    fn widen(self) -> f64 {
        self
    }
    fn narrow(w: f64) -> f64 {
        w
    }
}

impl HostFloat for bf16 {
    type W = f32;
    fn widen(self) -> f32 {
        self.to_f32()
    }
    fn narrow(w: f32) -> bf16 {
        bf16::from_f32(w)
    }
}
