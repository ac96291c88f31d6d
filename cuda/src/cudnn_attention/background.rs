//! Fused attention plans built on background threads while the step goes on: a forward that
//! cuDNN will serve in a step that records gradients asks for the plan its backward will need
//! ([`prepare_backward`], before the forward builds its own, so the two build side by side),
//! and a forward under a capture asks for its own ([`prepare_forward`]: the capture runs the
//! NVRTC kernels meanwhile). A thread with a cuDNN handle of its own (plans are built on one
//! handle while the op's handle runs) builds the plan, runs a backward's once on scratch
//! memory on a side stream (so the driver compiles its kernels there, not at the op's first
//! launch) and caches it with that handle. A device graph capture first waits for builds under
//! way ([`wait_for_all`]). An op waits for its key's build under way ([`wait_for`], at most
//! [`WAIT`]) instead of starting a second one; a refusal is cached like the op's own and
//! reported by the op, which falls back as it would have; any other failure leaves the op to
//! build the plan and report what it meets.

use std::ffi::c_void;
use std::sync::{Arc, Condvar, Mutex};
use std::time::Duration;

use super::{
    backward_operands, backward_refusal, build_plan, create_handle, ffi, sdpa, sizes, state_in,
    BackwardRun, BackwardViews, BackwardWorkspace, Cached, Key, NoPlan, State, STATE,
};
use crate::raw::{AttentionBackward, AttentionForward, Bhtd, FResult, FusedError};
use crate::{Block, CudaRuntime};
use ffi::{Api, Raw};

/// The longest an op waits for a background build before it builds the plan itself.
const WAIT: Duration = Duration::from_secs(300);

/// The end of one background build, signalled once.
#[derive(Default)]
pub(super) struct Pending {
    done: Mutex<bool>,
    ended: Condvar,
}

impl Pending {
    /// Marks the build ended and wakes every waiter.
    fn finish(&self) {
        *self.done.lock().unwrap_or_else(|p| p.into_inner()) = true;
        self.ended.notify_all();
    }
    /// Waits until the build ends or `limit` passes; whether it ended.
    fn wait(&self, limit: Duration) -> bool {
        let done = self.done.lock().unwrap_or_else(|p| p.into_inner());
        let (done, _) = self
            .ended
            .wait_timeout_while(done, limit, |d| !*d)
            .unwrap_or_else(|p| p.into_inner());
        *done
    }
}

/// Registers a background build of `key` in `st`, unless its plan is cached, refused or already
/// under way.
fn claim(st: &mut State, key: &Key) -> Option<Arc<Pending>> {
    if st.plans.contains_key(key) || st.refused.contains_key(key) || st.pending.contains_key(key) {
        return None;
    }
    let p = Arc::new(Pending::default());
    st.pending.insert(key.clone(), p.clone());
    Some(p)
}

/// Caches what the background build of `key` gave (a plan with its handle, or a refusal) and
/// ends its registration; gives back a plan it did not cache (the op built one meanwhile, after
/// its wait ran out).
fn settle(st: &mut State, key: &Key, built: Result<Cached, NoPlan>) -> Option<Cached> {
    let mut unused = None;
    match built {
        Ok(cached) => {
            if st.plans.contains_key(key) {
                unused = Some(cached);
            } else {
                st.plans.insert(key.clone(), cached);
            }
        }
        Err(NoPlan::Refused(detail)) => {
            st.refused.entry(key.clone()).or_insert(detail);
        }
        Err(NoPlan::Failed(e)) => {
            tracing::debug!("a background cuDNN attention plan failed: {e}");
        }
    }
    st.pending.remove(key);
    unused
}

/// Starts building the plan of forward `a` (its views' strides, type and sizes; its addresses
/// are not read) on a background thread, when cuDNN is in use, would take the call, and has no
/// plan or build for it yet.
pub(crate) fn prepare_forward(rt: &Arc<CudaRuntime>, a: &AttentionForward) {
    let op = "cudnn attention forward (background plan)";
    let s = a.shape;
    let views = [a.q, a.k, a.v, a.o];
    let Ok(z) = sizes(op, &s, &views) else {
        return;
    };
    let a = *a;
    start(
        rt,
        op,
        Key::of(false, &s, false, &views),
        |_| false,
        move |api, handle, _| {
            build_plan(api, handle, op, false, |g, var| {
                sdpa::forward(g, &z, &a.q, &a.k, &a.v, &a.o, var)
            })
            .map(|plan| Cached { plan, handle })
        },
    );
}

/// Starts building the plan of backward `a` (its views' strides, type and sizes; its addresses
/// are not read) on a background thread, when cuDNN is in use, would take the call, and has no
/// plan or build for it yet; the thread then runs it once on scratch memory ([`warm_up`]).
pub(crate) fn prepare_backward(rt: &Arc<CudaRuntime>, a: &AttentionBackward) {
    let op = "cudnn attention backward (background plan)";
    let s = a.shape;
    let views = backward_operands(a);
    let Ok(z) = sizes(op, &s, &views) else {
        return;
    };
    let key = Key::of(true, &s, a.deterministic, &views);
    let refused = move |st: &State| backward_refusal(st.version, s.seq).is_some();
    let a = *a;
    start(rt, op, key, refused, move |api, handle, rt| {
        let x = BackwardViews::of(&a);
        let plan = build_plan(api, handle, op, a.deterministic, |g, var| {
            sdpa::backward(g, &z, &x, a.deterministic, var)
        })?;
        let cached = Cached { plan, handle };
        let start = std::time::Instant::now();
        let warmed = warm_up(api, rt, &cached, &a);
        if warmed.is_ok() {
            let what = "cuDNN attention backward first run (on scratch)";
            crate::build_times::record_compiled(what, start);
        }
        match warmed {
            Ok(()) => Ok(cached),
            Err(w) if w.handle_usable => {
                tracing::debug!(
                    "the cuDNN attention backward warm-up did not run: {}",
                    w.error
                );
                Ok(cached)
            }
            // The handle is not back on the compute stream: neither it nor the plan is handed
            // over (the op builds its own).
            Err(w) => {
                drop(cached.plan);
                Err(NoPlan::Failed(*w.error))
            }
        }
    });
}

/// Starts `build` of the plan of `key` on a background thread with a cuDNN handle of its own
/// (destroyed unless `build` hands it over with the plan), unless cuDNN is missing, `refused`
/// holds for the process's state, or the key's plan is cached, refused or under way; the
/// thread caches what it gives ([`settle`]).
fn start(
    rt: &Arc<CudaRuntime>,
    op: &'static str,
    key: Key,
    refused: impl FnOnce(&State) -> bool,
    build: impl FnOnce(&'static Api, Raw, &Arc<CudaRuntime>) -> Result<Cached, NoPlan> + Send + 'static,
) {
    let Ok(api) = ffi::api(op) else {
        return;
    };
    let pending = {
        let mut g = STATE.lock().unwrap_or_else(|p| p.into_inner());
        // The first forward's call comes before that forward makes the process's state: make
        // it here, so the plans build side by side from the first layer on.
        let Ok(st) = state_in(&mut g, api, rt, op) else {
            return;
        };
        if refused(st) {
            return;
        }
        match claim(st, &key) {
            Some(p) => p,
            None => return,
        }
    };
    let rt = rt.clone();
    let job = {
        let (key, pending) = (key.clone(), pending.clone());
        move || {
            crate::build_times::mark_background_thread();
            let built = create_handle(api, &rt, op)
                .map_err(NoPlan::Failed)
                .and_then(|handle| {
                    build(api, handle, &rt).inspect_err(|_| {
                        // SAFETY: the handle is live, and nothing else holds it after a
                        // failed build.
                        unsafe { (api.destroy)(handle) };
                    })
                });
            let mut g = STATE.lock().unwrap_or_else(|p| p.into_inner());
            let unused = g.as_mut().and_then(|st| settle(st, &key, built));
            drop(g);
            pending.finish();
            if let Some(Cached { plan, handle }) = unused {
                drop(plan);
                // SAFETY: the handle is live and held by nothing else now its plan is dropped.
                unsafe { (api.destroy)(handle) };
            }
        }
    };
    let spawned = std::thread::Builder::new()
        .name("oxiflow-cudnn-plan".into())
        .spawn(job);
    if spawned.is_err() {
        let mut g = STATE.lock().unwrap_or_else(|p| p.into_inner());
        if let Some(st) = g.as_mut() {
            st.pending.remove(&key);
        }
        drop(g);
        pending.finish();
    }
}

/// Whether the plan of `key` is cached (a call for it builds nothing and waits for nothing).
pub(super) fn is_cached(key: &Key) -> bool {
    let g = STATE.lock().unwrap_or_else(|p| p.into_inner());
    g.as_ref().is_some_and(|st| st.plans.contains_key(key))
}

/// Why a warm-up did not run, and whether the handle is still on the compute stream (so the
/// plan can be handed over).
struct WarmUpFailed {
    error: Box<FusedError>,
    handle_usable: bool,
}

impl From<FusedError> for WarmUpFailed {
    fn from(error: FusedError) -> WarmUpFailed {
        WarmUpFailed {
            error: Box::new(error),
            handle_usable: true,
        }
    }
}

/// Runs the freshly built plan `cached` once, for the shapes and strides of `a`, on scratch
/// memory and a stream forked from the compute stream: cuDNN's runtime-compiled kernels are
/// loaded, and their PTX compiled by the driver, at their first launch, which then happens on
/// this thread instead of in the backward op. The results are discarded; whatever reached the
/// side stream, the compute stream waits for it before the scratch memory goes back to the
/// pool. It is skipped where the scratch would take over an eighth of the free device memory;
/// a failure or a skip only leaves that compile to the op, unless the handle could not be put
/// back on the compute stream.
fn warm_up(
    api: &'static Api,
    rt: &Arc<CudaRuntime>,
    cached: &Cached,
    a: &AttentionBackward,
) -> Result<(), WarmUpFailed> {
    let op = "cudnn attention backward (warm-up)";
    let s = a.shape;
    let dims = [s.batch, s.heads, s.seq, s.head_dim];
    let extent = |v: &Bhtd| {
        1 + dims
            .iter()
            .zip(v.strides)
            .map(|(&n, st)| n.saturating_sub(1) * st.max(0) as usize)
            .sum::<usize>()
    };
    let elem = s.dtype.size();
    // The inputs share one block, and so do the three gradients (their values are not read).
    let widest = |views: &[Bhtd]| views.iter().map(extent).max().unwrap_or(1) * elem;
    let inputs = widest(&[a.q, a.k, a.v, a.o, a.d_o]);
    let outputs = widest(&[a.dq, a.dk, a.dv]);
    let lse_bytes = s.batch * s.heads * s.seq * 4;
    let ws = BackwardWorkspace::of(&cached.plan, a);
    // Skipped where the scratch would take a large part of the free memory: the op then
    // compiles the kernels at its first launch, as it would without this run.
    let (free, _) = rt.memory_info().map_err(FusedError::from)?;
    let scratch = inputs + outputs + lse_bytes + ws.bytes;
    if scratch > free / 8 {
        return Err(FusedError::Unavailable {
            op,
            lib: "cuDNN",
            detail: format!("{scratch} bytes of scratch with {free} bytes free"),
        }
        .into());
    }
    let alloc = |bytes| Block::alloc(rt, bytes).map_err(FusedError::from);
    let (input, output, lse, work) = (
        alloc(inputs)?,
        alloc(outputs)?,
        alloc(lse_bytes)?,
        alloc(ws.bytes)?,
    );
    let mut w = *a;
    for v in [&mut w.q, &mut w.k, &mut w.v, &mut w.o, &mut w.d_o] {
        v.ptr = input.ptr();
    }
    for v in [&mut w.dq, &mut w.dk, &mut w.dv] {
        v.ptr = output.ptr();
    }
    w.lse = lse.ptr();
    let drv = |what: &str, e: cudarc::driver::DriverError| {
        FusedError::Tensor(crate::derr(op, format!("{what}: {e}")))
    };
    let on = |stream: &cudarc::driver::CudaStream| {
        // SAFETY: the handle is live and used by this thread alone until it is handed over;
        // the stream belongs to its context.
        let st = unsafe { (api.set_stream)(cached.handle, stream.cu_stream() as *mut c_void) };
        match st {
            0 => Ok(()),
            st => Err(FusedError::Unavailable {
                op,
                lib: "cuDNN",
                detail: format!("cudnnSetStream: {}", api.describe(st)),
            }),
        }
    };
    // The side stream starts after the compute stream's work so far, which includes every
    // earlier use of the scratch blocks.
    let side = rt.stream().fork().map_err(|e| drv("forking a stream", e))?;
    let mut moved = false;
    let ran = (|| -> FResult<()> {
        for (ptr, bytes) in [(input.ptr(), inputs), (lse.ptr(), lse_bytes)] {
            // SAFETY: each range lies inside its block, which outlives the side stream's work
            // (the compute stream waits for it below, before the blocks are dropped).
            unsafe { cudarc::driver::result::memset_d8_async(ptr, 0, bytes, side.cu_stream()) }
                .map_err(|e| drv("zeroing the scratch inputs", e))?;
        }
        on(&side)?;
        moved = true;
        // SAFETY: no arguments.
        let version = unsafe { (api.version)() };
        let run = BackwardRun {
            api,
            op,
            rt,
            stream: &side,
            version,
        };
        run.execute(cached, &w, &ws, work.ptr())
    })();
    let back = if moved { on(rt.stream()) } else { Ok(()) };
    let joined = rt
        .stream()
        .join(&side)
        .map_err(|e| drv("ordering the compute stream", e));
    if let Err(error) = back {
        return Err(WarmUpFailed {
            error: Box::new(error),
            handle_usable: false,
        });
    }
    if let Err(error) = joined {
        // The blocks may still be in use by the side stream: they are kept, not reused.
        std::mem::forget((input, output, lse, work));
        return Err(error.into());
    }
    Ok(ran?)
}

/// Waits (at most [`WAIT`] each) for every background build under way: a capture on the
/// compute stream must not see a build's warm-up order that stream after its side stream.
pub(crate) fn wait_for_all() {
    let pending: Vec<Arc<Pending>> = {
        let g = STATE.lock().unwrap_or_else(|p| p.into_inner());
        g.as_ref()
            .map(|st| st.pending.values().cloned().collect())
            .unwrap_or_default()
    };
    for p in pending {
        if !p.wait(WAIT) {
            tracing::warn!("a background cuDNN attention plan took over {WAIT:?}");
        }
    }
}

/// Waits (at most [`WAIT`]) for the background build of `key`, when one is under way.
pub(super) fn wait_for(key: &Key) {
    let pending = {
        let g = STATE.lock().unwrap_or_else(|p| p.into_inner());
        g.as_ref().and_then(|st| st.pending.get(key).cloned())
    };
    if let Some(p) = pending {
        if !p.wait(WAIT) {
            tracing::warn!(
                "the background cuDNN attention backward plan took over {WAIT:?}; the op builds it"
            );
        }
    }
}

#[cfg(test)]
mod tests {
    use std::collections::HashMap;

    use super::super::FloatType;
    use super::*;
    use crate::raw::FusedError;
    use crate::raw::{AttentionShape, Bhtd};

    fn state() -> State {
        State {
            handle: std::ptr::null_mut(),
            version: 91900,
            plans: HashMap::new(),
            refused: HashMap::new(),
            pending: HashMap::new(),
        }
    }

    fn backward_args(seq: usize) -> AttentionBackward {
        let v = Bhtd::bthd(0, seq, 12, 64);
        AttentionBackward {
            shape: AttentionShape {
                batch: 8,
                heads: 12,
                seq,
                head_dim: 64,
                causal: true,
                scale: 0.125,
                dtype: FloatType::Bf16,
            },
            q: v,
            k: v,
            v,
            o: v,
            d_o: v,
            lse: 0,
            dq: v,
            dk: v,
            dv: v,
            deterministic: false,
        }
    }

    fn key(a: &AttentionBackward) -> Key {
        Key::of(true, &a.shape, a.deterministic, &backward_operands(a))
    }

    #[test]
    fn one_build_a_key_and_none_for_a_cached_or_refused_plan() {
        let mut st = state();
        let k = key(&backward_args(1024));
        let p = claim(&mut st, &k).expect("the first claim");
        assert!(claim(&mut st, &k).is_none(), "a second build of one key");
        let other = key(&backward_args(2048));
        assert!(claim(&mut st, &other).is_some(), "another shape builds");
        let unused = settle(
            &mut st,
            &k,
            Err(NoPlan::Failed(FusedError::Invalid {
                op: "t",
                detail: "d".into(),
            })),
        );
        assert!(unused.is_none());
        // A failure caches nothing: the op builds (and reports) it; a new claim may start.
        assert!(st.plans.is_empty() && st.refused.is_empty());
        assert!(!st.pending.contains_key(&k));
        assert!(claim(&mut st, &k).is_some());
        assert!(settle(&mut st, &k, Err(NoPlan::Refused("no engine".into()))).is_none());
        assert_eq!(st.refused.get(&k).map(String::as_str), Some("no engine"));
        assert!(
            claim(&mut st, &k).is_none(),
            "a refused key is not built again"
        );
        drop(p);
    }

    #[test]
    fn the_prepared_key_is_the_backward_ops_key() {
        // `prepare_backward` and `backward` key a call alike; the forward and backward of one
        // shape do not share a key.
        let a = backward_args(1024);
        let mut b = a;
        b.dq = Bhtd::bthd(4096, 1024, 12, 64);
        assert_eq!(key(&a), key(&b), "addresses are not part of the key");
        b.deterministic = true;
        assert_ne!(key(&a), key(&b));
        let fwd = Key::of(false, &a.shape, false, &[a.q, a.k, a.v, a.o]);
        assert_ne!(key(&a), fwd);
    }

    #[test]
    fn a_waiter_wakes_when_the_build_ends_and_gives_up_after_its_limit() {
        let p = Arc::new(Pending::default());
        assert!(!p.wait(Duration::from_millis(20)), "nothing ended");
        let q = p.clone();
        let t = std::thread::spawn(move || {
            std::thread::sleep(Duration::from_millis(30));
            q.finish();
        });
        let start = std::time::Instant::now();
        assert!(p.wait(Duration::from_secs(10)));
        assert!(start.elapsed() < Duration::from_secs(5));
        t.join().unwrap();
        assert!(p.wait(Duration::ZERO), "an ended build stays ended");
    }
}
