//! Fused (flash) attention through cuDNN's backend graph API: the forward writes O and the
//! log-sum-exp of each row (f32 `[B, H, T]`), the backward writes dQ, dK, dV from Q, K, V, O, dO
//! and that statistic; `[B, H, T, T]` never reaches memory. Q, K, V, O and the gradients are
//! strided views (`Bhtd`), so Q, K, V can be slices of one fused QKV buffer and O can be laid out
//! `[B, T, H, D]`.
//!
//! cuDNN is loaded at run time (`cuda_libs::ensure_cudnn`); one handle per process sits on the
//! runtime's compute stream; execution plans are cached by everything that shapes them (sizes,
//! type, causal, strides, determinism), a backward's possibly built ahead, and run once on
//! scratch memory so its kernels are compiled, on a background thread with a handle of its own
//! (`background`); workspaces come from the runtime's
//! allocator. cuDNN's flash engines take bf16 and f16 only: f32 is `Unsupported`. A missing
//! library, a refused graph or unsupported arguments come back as errors for which
//! `is_fallback()` holds.

mod background;
mod ffi;
mod graph;
mod sdpa;

use std::collections::HashMap;
use std::ffi::c_void;
use std::sync::{Arc, Mutex};

use super::raw::{
    AttentionBackward, AttentionForward, AttentionShape, Bhtd, FResult, FloatType, FusedError,
};
use super::{Block, CudaRuntime};
use ffi::{Api, Raw};
use graph::{Graph, Plan};
use sdpa::{uid, BackwardViews, Sizes, VARIANTS};

pub(crate) use background::{
    prepare_backward, prepare_forward, wait_for_all as wait_for_background_plans,
};

#[derive(Clone, Debug, PartialEq, Eq, Hash)]
struct Key {
    backward: bool,
    dims: [usize; 4],
    dtype: FloatType,
    causal: bool,
    deterministic: bool,
    strides: Vec<[i64; 4]>,
}

impl Key {
    /// The key of a forward (`views` Q, K, V, O) or backward (Q, K, V, O, dO, dQ, dK, dV) call.
    fn of(backward: bool, s: &AttentionShape, deterministic: bool, views: &[Bhtd]) -> Key {
        Key {
            backward,
            dims: [s.batch, s.heads, s.seq, s.head_dim],
            dtype: s.dtype,
            causal: s.causal,
            deterministic,
            strides: views.iter().map(|v| v.strides).collect(),
        }
    }
}

/// The operands of backward call `a` in the order its key and graph take them: Q, K, V, O, dO,
/// dQ, dK, dV.
fn backward_operands(a: &AttentionBackward) -> [Bhtd; 8] {
    [a.q, a.k, a.v, a.o, a.d_o, a.dq, a.dk, a.dv]
}

/// A cached plan and the handle it runs with: the process's handle, or the one of the
/// background thread that built it (a plan runs on the handle that made it).
struct Cached {
    plan: Plan,
    handle: Raw,
}

/// The process's cuDNN handle and plans.
struct State {
    handle: Raw,
    version: usize,
    plans: HashMap<Key, Cached>,
    /// Keys cuDNN refused, with the reason (not retried).
    refused: HashMap<Key, String>,
    /// Plans being built on a background thread ([`background`]).
    pending: HashMap<Key, Arc<background::Pending>>,
}

// SAFETY: the handles and the plans' descriptors in a State are used only under the STATE
// mutex (a background build uses its handle and plan alone until it hands them over under the
// mutex); cuDNN allows a handle to be used from any thread as long as calls are not concurrent.
unsafe impl Send for State {}

static STATE: Mutex<Option<State>> = Mutex::new(None);

/// The cuDNN version number (e.g. 91900 for 9.19.0), loading cuDNN if needed.
pub fn cudnn_version(op: &'static str) -> FResult<usize> {
    let api = ffi::api(op)?;
    // SAFETY: cudnnGetVersion takes no arguments and has no preconditions.
    Ok(unsafe { (api.version)() })
}

/// Where cuDNN was loaded from, its version and sub-libraries, and a line per cached plan
/// (what it serves, which engine configuration).
pub fn cudnn_report() -> Vec<String> {
    let mut out = Vec::new();
    match oxiflow_collectives::cuda_libs::ensure_cudnn(
        &oxiflow_collectives::cuda_libs::LibSearch::default(),
    ) {
        Ok(l) => {
            out.push(format!(
                "cuDNN {} with {} sub-libraries",
                l.main.path.display(),
                l.loaded.len()
            ));
            for (p, e) in &l.failed {
                out.push(format!(
                    "cuDNN sub-library {} did not load: {e}",
                    p.display()
                ));
            }
        }
        Err(e) => out.push(format!("cuDNN: {e}")),
    }
    let g = STATE.lock().unwrap_or_else(|p| p.into_inner());
    if let Some(st) = g.as_ref() {
        for (k, p) in &st.plans {
            out.push(format!(
                "cuDNN plan {} {:?} {:?} causal {} det {}: {} (workspace {} bytes)",
                if k.backward { "bwd" } else { "fwd" },
                k.dims,
                k.dtype,
                k.causal,
                k.deterministic,
                p.plan.source,
                p.plan.workspace
            ));
        }
    }
    out
}

/// The process's state in `g`, made (with its handle on `rt`'s compute stream) if there is
/// none yet.
fn state_in<'g>(
    g: &'g mut Option<State>,
    api: &'static Api,
    rt: &CudaRuntime,
    op: &'static str,
) -> FResult<&'g mut State> {
    if g.is_none() {
        let handle = create_handle(api, rt, op)?;
        // SAFETY: no arguments.
        let version = unsafe { (api.version)() };
        *g = Some(State {
            handle,
            version,
            plans: HashMap::new(),
            refused: HashMap::new(),
            pending: HashMap::new(),
        });
    }
    g.as_mut().ok_or_else(|| FusedError::Unavailable {
        op,
        lib: "cuDNN",
        detail: "no handle".into(),
    })
}

/// Loads cuDNN and creates the process's handle, so the first attention (and the background
/// build of its backward's plan, which starts from it) does not wait for them. Run on a
/// start-up background thread; a missing library or a failure is left for the first op to
/// meet and report.
pub(crate) fn start_up(rt: &CudaRuntime) {
    let op = "cudnn start-up";
    let start = std::time::Instant::now();
    let Ok(api) = ffi::api(op) else {
        return;
    };
    let mut g = STATE.lock().unwrap_or_else(|p| p.into_inner());
    if state_in(&mut g, api, rt, op).is_ok() {
        super::build_times::record_compiled("cuDNN library and handle", start);
    }
}

fn with_state<R>(
    rt: &CudaRuntime,
    op: &'static str,
    f: impl FnOnce(&'static Api, &mut State) -> FResult<R>,
) -> FResult<R> {
    let api = ffi::api(op)?;
    let mut g = STATE.lock().unwrap_or_else(|p| p.into_inner());
    f(api, state_in(&mut g, api, rt, op)?)
}

/// A cuDNN handle of this thread's runtime, on its compute stream.
fn create_handle(api: &'static Api, rt: &CudaRuntime, op: &'static str) -> FResult<Raw> {
    rt.bind(op)?;
    let mut handle: Raw = std::ptr::null_mut();
    // SAFETY: handle is a valid out-pointer; the device's context is current.
    let s = unsafe { (api.create)(&mut handle) };
    if s != 0 {
        return Err(FusedError::Unavailable {
            op,
            lib: "cuDNN",
            detail: format!("cudnnCreate: {}", api.describe(s)),
        });
    }
    // SAFETY: handle is live; the stream belongs to the current context.
    let s = unsafe { (api.set_stream)(handle, rt.stream().cu_stream() as *mut c_void) };
    if s != 0 {
        // SAFETY: handle is live and not used again.
        unsafe { (api.destroy)(handle) };
        return Err(FusedError::Unavailable {
            op,
            lib: "cuDNN",
            detail: format!("cudnnSetStream: {}", api.describe(s)),
        });
    }
    Ok(handle)
}

/// Why a build gave no plan: cuDNN refused every graph variant (why), or a call failed.
enum NoPlan {
    Refused(String),
    Failed(FusedError),
}

/// A plan built on `handle` by `build` over the graph variants, the first cuDNN accepts.
fn build_plan(
    api: &'static Api,
    handle: Raw,
    op: &'static str,
    deterministic: bool,
    build: impl Fn(&mut Graph, sdpa::Variant) -> FResult<()>,
) -> Result<Plan, NoPlan> {
    let mut errors = Vec::new();
    for var in VARIANTS {
        let start = std::time::Instant::now();
        let mut g = Graph::new(api, op);
        match build(&mut g, var).and_then(|_| g.plan(handle, deterministic)) {
            Ok(plan) => {
                super::build_times::record_compiled(format!("cuDNN {op} plan {var:?}"), start);
                return Ok(plan);
            }
            Err(e) if e.is_fallback() => errors.push(format!("{var:?}: {e}")),
            Err(e) => return Err(NoPlan::Failed(e)),
        }
    }
    Err(NoPlan::Refused(errors.join(" | ")))
}

/// The cached plan for `key`, built by `build` on the process's handle on first use (a refusal
/// is kept and reported again).
fn plan_for<'s>(
    api: &'static Api,
    st: &'s mut State,
    op: &'static str,
    key: Key,
    build: impl Fn(&mut Graph, sdpa::Variant) -> FResult<()>,
) -> FResult<&'s Cached> {
    if let Some(why) = st.refused.get(&key) {
        return Err(FusedError::Refused {
            op,
            lib: "cuDNN",
            what: "this attention graph (earlier)".into(),
            detail: why.clone(),
        });
    }
    if !st.plans.contains_key(&key) {
        match build_plan(api, st.handle, op, key.deterministic, build) {
            Ok(plan) => {
                let handle = st.handle;
                st.plans.insert(key.clone(), Cached { plan, handle });
            }
            Err(NoPlan::Refused(detail)) => {
                st.refused.insert(key, detail.clone());
                return Err(FusedError::Refused {
                    op,
                    lib: "cuDNN",
                    what: "the attention graph".into(),
                    detail,
                });
            }
            Err(NoPlan::Failed(e)) => return Err(e),
        }
    }
    st.plans
        .get(&key)
        .ok_or_else(|| super::raw::invalid(op, "plan missing after caching"))
}

/// Why cuDNN `version` cannot run the backward of sequence length `seq`, if it cannot.
fn backward_refusal(version: usize, seq: usize) -> Option<String> {
    (version <= 91500 && !seq.is_multiple_of(128))
        .then(|| format!("cuDNN {version} needs a padding mask there (fixed in 9.15.1)"))
}

fn sizes(op: &'static str, s: &super::raw::AttentionShape, views: &[Bhtd]) -> FResult<Sizes> {
    if s.dtype == FloatType::F32 {
        return Err(FusedError::Unsupported {
            op,
            detail: "cuDNN's fused attention takes bf16 or f16 operands, not f32".into(),
        });
    }
    if !s.head_dim.is_multiple_of(8) || s.head_dim > 256 {
        return Err(FusedError::Unsupported {
            op,
            detail: format!("cuDNN's fused attention needs a head size that is a multiple of 8 up to 256, not {}", s.head_dim),
        });
    }
    if let Some(v) = views.iter().find(|v| v.strides[3] != 1) {
        return Err(FusedError::Unsupported {
            op,
            detail: format!(
                "cuDNN needs a unit stride along the head dim, got strides {:?}",
                v.strides
            ),
        });
    }
    Ok(Sizes {
        b: s.batch as i64,
        h: s.heads as i64,
        t: s.seq as i64,
        d: s.head_dim as i64,
        io: sdpa::io_type(s.dtype),
        causal: s.causal,
    })
}

fn neg_inf(version: usize) -> f32 {
    if version >= 91000 {
        f32::NEG_INFINITY
    } else {
        f32::MIN
    }
}

fn dev(p: u64) -> *mut c_void {
    p as *mut c_void
}

/// Whether cuDNN's plan for forward `a` is cached (a call builds nothing and waits for nothing).
pub(crate) fn forward_is_cached(a: &AttentionForward) -> bool {
    background::is_cached(&Key::of(false, &a.shape, false, &[a.q, a.k, a.v, a.o]))
}

/// Whether cuDNN's plan for backward `a` is cached.
pub(crate) fn backward_is_cached(a: &AttentionBackward) -> bool {
    background::is_cached(&Key::of(
        true,
        &a.shape,
        a.deterministic,
        &backward_operands(a),
    ))
}

/// Runs the fused attention forward through cuDNN.
pub fn forward(rt: &Arc<CudaRuntime>, a: &AttentionForward) -> FResult<()> {
    let op = "cudnn attention forward";
    a.check(op)?;
    let s = a.shape;
    let views = [a.q, a.k, a.v, a.o];
    let z = sizes(op, &s, &views)?;
    let key = Key::of(false, &s, false, &views);
    // A plan under way on a background thread is waited for, not built twice.
    background::wait_for(&key);
    with_state(rt, op, |api, st| {
        let version = st.version;
        let cached = plan_for(api, st, op, key, |g, var| {
            sdpa::forward(g, &z, &a.q, &a.k, &a.v, &a.o, var)
        })?;
        let ws = Block::alloc(rt, cached.plan.workspace.max(1))?;
        let (mut scale, mut ninf) = (s.scale, neg_inf(version));
        let bind = [
            (uid::Q, dev(a.q.ptr)),
            (uid::K, dev(a.k.ptr)),
            (uid::V, dev(a.v.ptr)),
            (uid::O, dev(a.o.ptr)),
            (uid::STATS, dev(a.lse)),
            (uid::SCALE, (&mut scale as *mut f32).cast()),
            (uid::NEG_INF, (&mut ninf as *mut f32).cast()),
        ];
        let bind: Vec<_> = bind
            .into_iter()
            .filter(|b| s.causal || b.0 != uid::NEG_INF)
            .collect();
        rt.bind(op)?;
        cached.plan.execute(api, op, cached.handle, &bind, ws.ptr())
    })
}

/// Runs the fused attention backward through cuDNN.
pub fn backward(rt: &Arc<CudaRuntime>, a: &AttentionBackward) -> FResult<()> {
    let op = "cudnn attention backward";
    a.check(op)?;
    let s = a.shape;
    let views = backward_operands(a);
    let z = sizes(op, &s, &views)?;
    let key = Key::of(true, &s, a.deterministic, &views);
    // A plan under way on a background thread is waited for, not built twice.
    background::wait_for(&key);
    let x = BackwardViews::of(a);
    with_state(rt, op, |api, st| {
        if let Some(detail) = backward_refusal(st.version, s.seq) {
            return Err(FusedError::Refused {
                op,
                lib: "cuDNN",
                what: format!("a backward with sequence length {}", s.seq),
                detail,
            });
        }
        let version = st.version;
        let cached = plan_for(api, st, op, key, |g, var| {
            sdpa::backward(g, &z, &x, a.deterministic, var)
        })?;
        let ws = BackwardWorkspace::of(&cached.plan, a);
        let block = Block::alloc(rt, ws.bytes)?;
        let run = BackwardRun {
            api,
            op,
            rt,
            stream: rt.stream(),
            version,
        };
        run.execute(cached, a, &ws, block.ptr())
    })
}

/// Where a backward's workspace puts the plan's own part, Dsum (f32 `[b, h, t]`) and the dQ
/// accumulator (f32, absent when deterministic), and its size.
struct BackwardWorkspace {
    off_sum: usize,
    off_acc: usize,
    acc_bytes: usize,
    bytes: usize,
}

impl BackwardWorkspace {
    fn of(plan: &Plan, a: &AttentionBackward) -> BackwardWorkspace {
        let s = a.shape;
        let align = |n: usize| n.div_ceil(256) * 256;
        let rows = s.batch * s.heads * s.seq;
        let (off_sum, off_acc) = (
            align(plan.workspace),
            align(plan.workspace) + align(rows * 4),
        );
        let acc_bytes = if a.deterministic {
            0
        } else {
            rows * s.head_dim * 4
        };
        BackwardWorkspace {
            off_sum,
            off_acc,
            acc_bytes,
            bytes: off_acc + acc_bytes.max(1),
        }
    }
}

/// What one execution of a backward plan runs with: the API, the op's name, the runtime, the
/// stream its handle is on and the cuDNN version.
struct BackwardRun<'r> {
    api: &'static Api,
    op: &'static str,
    rt: &'r CudaRuntime,
    stream: &'r cudarc::driver::CudaStream,
    version: usize,
}

impl BackwardRun<'_> {
    /// Executes `cached` for `a`, the workspace laid out `ws` at device address `base`.
    fn execute(
        &self,
        cached: &Cached,
        a: &AttentionBackward,
        ws: &BackwardWorkspace,
        base: u64,
    ) -> FResult<()> {
        let (api, op, s) = (self.api, self.op, a.shape);
        if ws.acc_bytes > 0 && self.version < 90600 {
            self.rt.bind(op)?;
            // SAFETY: the accumulator lies inside the workspace block; the memset is ordered on
            // the plan's stream before the execution below.
            unsafe {
                cudarc::driver::result::memset_d8_async(
                    base + ws.off_acc as u64,
                    0,
                    ws.acc_bytes,
                    self.stream.cu_stream(),
                )
            }
            .map_err(|e| {
                FusedError::Tensor(super::derr(op, format!("zeroing dQ accumulator: {e}")))
            })?;
        }
        let (mut scale, mut ninf, mut one) = (s.scale, neg_inf(self.version), 1.0f32);
        let mut bind = vec![
            (uid::Q, dev(a.q.ptr)),
            (uid::K, dev(a.k.ptr)),
            (uid::V, dev(a.v.ptr)),
            (uid::O, dev(a.o.ptr)),
            (uid::D_O, dev(a.d_o.ptr)),
            (uid::STATS, dev(a.lse)),
            (uid::DQ, dev(a.dq.ptr)),
            (uid::DK, dev(a.dk.ptr)),
            (uid::DV, dev(a.dv.ptr)),
            (uid::SCALE, (&mut scale as *mut f32).cast()),
            (uid::ONE, (&mut one as *mut f32).cast()),
            (uid::SOFTMAX_SUM, dev(base + ws.off_sum as u64)),
        ];
        if s.causal {
            bind.push((uid::NEG_INF, (&mut ninf as *mut f32).cast()));
        }
        if ws.acc_bytes > 0 {
            bind.push((uid::DQ_ACCUM, dev(base + ws.off_acc as u64)));
        }
        self.rt.bind(op)?;
        cached.plan.execute(api, op, cached.handle, &bind, base)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_missing_cudnn_is_a_fallback_error_not_a_panic() {
        // Without a CUDA driver or cuDNN (CI), binding the API fails with `Unavailable`.
        if let Err(e) = ffi::api("test") {
            assert!(
                matches!(e, FusedError::Unavailable { lib: "cuDNN", .. }),
                "{e}"
            );
            assert!(e.is_fallback());
        }
    }

    #[test]
    fn f32_and_odd_head_sizes_are_refused_with_typed_errors() {
        let shape = |head_dim, dtype| super::super::raw::AttentionShape {
            batch: 1,
            heads: 1,
            seq: 8,
            head_dim,
            causal: true,
            scale: 0.5,
            dtype,
        };
        let v = Bhtd::bthd(16, 8, 1, 64);
        let e = sizes("t", &shape(64, FloatType::F32), &[v]).err();
        assert!(matches!(e, Some(FusedError::Unsupported { .. })), "{e:?}");
        let e = sizes("t", &shape(60, FloatType::Bf16), &[v]).err();
        assert!(matches!(e, Some(FusedError::Unsupported { .. })), "{e:?}");
        let strided = Bhtd {
            ptr: 16,
            strides: [512, 64, 64, 2],
        };
        let e = sizes("t", &shape(64, FloatType::Bf16), &[strided]).err();
        assert!(matches!(e, Some(FusedError::Unsupported { .. })), "{e:?}");
        assert!(sizes("t", &shape(64, FloatType::Bf16), &[v]).is_ok());
    }
}
