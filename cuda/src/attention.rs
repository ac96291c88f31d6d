//! Fused attention on the device: cuDNN's flash engines when cuDNN is present and accepts the
//! call, else the NVRTC flash kernels, with the fallback and its reason logged once per reason.
//! Under a compile's capture, a call whose cuDNN plan is not cached yet runs the NVRTC kernels
//! while the plan builds in the background (the capture's values are provisional: the compile
//! gives the step's outputs from its first replay, which runs cuDNN).

use std::collections::HashSet;
use std::sync::{Arc, Mutex};

use super::raw::{AttentionBackward, AttentionForward, FResult, FloatType, FusedError};
use super::{cudnn_attention, flash_attention, CudaRuntime};

/// Which implementation ran.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum AttentionPath {
    Cudnn,
    /// The NVRTC kernels, and why cuDNN did not serve the call.
    Flash {
        reason: String,
    },
}

static LOGGED: Mutex<Option<HashSet<String>>> = Mutex::new(None);

fn log_fallback(e: &FusedError) -> String {
    let reason = e.to_string();
    let mut g = LOGGED.lock().unwrap_or_else(|p| p.into_inner());
    if g.get_or_insert_with(HashSet::new).insert(reason.clone()) {
        tracing::warn!("fused attention falls back to the NVRTC flash kernels: {reason}");
    }
    reason
}

/// What served fused attention in this process: cuDNN's library and cached plans, and every
/// reason a call fell back to the NVRTC flash kernels.
pub fn fused_attention_report() -> Vec<String> {
    let mut out = cudnn_attention::cudnn_report();
    let g = LOGGED.lock().unwrap_or_else(|p| p.into_inner());
    out.extend(
        g.iter()
            .flatten()
            .map(|r| format!("fell back to the NVRTC flash kernels: {r}")),
    );
    out
}

/// Whether a call of `dtype` whose cuDNN plan is not cached runs the NVRTC kernels now, its
/// plan building in the background: under a capture whose device values are replaced (a
/// compile's: its first replay gives the step's values, with the plans it waits for), when
/// those kernels load without compiling.
fn provisional(rt: &CudaRuntime, dtype: FloatType, cached: impl FnOnce() -> bool) -> bool {
    oxiflow_tensor::capture::device_values_replaced()
        && flash_attention::loads_at_once(rt, dtype)
        && !cached()
}

const PROVISIONAL: &str = "a capture's provisional values while cuDNN's plan builds";

/// One attention pass's two ways: whether cuDNN's plan for a call is cached, starting to build
/// it, and running the call through cuDNN or through the NVRTC flash kernels.
struct Pass<A> {
    cached: fn(&A) -> bool,
    prepare: fn(&Arc<CudaRuntime>, &A),
    cudnn: fn(&Arc<CudaRuntime>, &A) -> FResult<()>,
    flash: fn(&Arc<CudaRuntime>, &A) -> FResult<()>,
}

impl<A> Pass<A> {
    /// Runs `a` (of element type `dtype`) through cuDNN, or the fallback where cuDNN refuses
    /// it or its plan is still building while a capture runs.
    fn run(&self, rt: &Arc<CudaRuntime>, a: &A, dtype: FloatType) -> FResult<AttentionPath> {
        if provisional(rt, dtype, || (self.cached)(a)) {
            (self.prepare)(rt, a);
            // Arguments the NVRTC kernels refuse (checked before they launch) leave the call
            // to cuDNN, which waits for the plan.
            if (self.flash)(rt, a).is_ok() {
                return Ok(AttentionPath::Flash {
                    reason: PROVISIONAL.into(),
                });
            }
        }
        match (self.cudnn)(rt, a) {
            Ok(()) => Ok(AttentionPath::Cudnn),
            Err(e) if e.is_fallback() => {
                let reason = log_fallback(&e);
                (self.flash)(rt, a)?;
                Ok(AttentionPath::Flash { reason })
            }
            Err(e) => Err(e),
        }
    }
}

/// O and the log-sum-exp of `a`, through cuDNN or the fallback.
pub fn attention_forward(rt: &Arc<CudaRuntime>, a: &AttentionForward) -> FResult<AttentionPath> {
    let pass = Pass {
        cached: cudnn_attention::forward_is_cached,
        prepare: cudnn_attention::prepare_forward,
        cudnn: cudnn_attention::forward,
        flash: flash_attention::forward,
    };
    pass.run(rt, a, a.shape.dtype)
}

/// Starts building cuDNN's plan for backward `a` in the background when cuDNN will serve it
/// (see `cudnn_attention::prepare_backward`); its addresses are not read.
pub fn prepare_attention_backward(rt: &Arc<CudaRuntime>, a: &AttentionBackward) {
    cudnn_attention::prepare_backward(rt, a);
}

/// dQ, dK, dV of `a`, through cuDNN or the fallback.
pub fn attention_backward(rt: &Arc<CudaRuntime>, a: &AttentionBackward) -> FResult<AttentionPath> {
    let pass = Pass {
        cached: cudnn_attention::backward_is_cached,
        prepare: cudnn_attention::prepare_backward,
        cudnn: cudnn_attention::backward,
        flash: flash_attention::backward,
    };
    pass.run(rt, a, a.shape.dtype)
}
