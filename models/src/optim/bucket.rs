//! Data-parallel gradient reduction in buckets, launched during the backward pass. A
//! [`GradBuckets`] is the backward walk's [`GradReadyHook`] for the parameters broadcast on the
//! data-parallel mesh axis (a context-parallel one where the data-parallel axis holds one rank
//! and ZeRO is off; and ZeRO-2's master shards, whose gradients arrive whole): it takes
//! their gradients (partial sums on that axis) as they become final, in the walk's order (the
//! reverse of their use), fills a bucket per dtype, placement and target until it holds
//! `cap_bytes` of gradients, and reduces the bucket with one collective over that axis
//! ([`reduce_bucket`]): an all-reduce into the parameters' layout, or, where the leaf's
//! gradient goes to a shard (ZeRO-2), a reduce-scatter straight into it. What no full bucket
//! took is reduced when the walk ends. Under gradient accumulation the earlier parts run in
//! [`SyncMode::Defer`]: the gradients accumulate locally as partial sums and only the last
//! part reduces. A bucket may move as another float dtype than the gradients' (`wire`: bf16
//! halves the bytes of f32 gradients; each rank's part is rounded once before the sum).
//! Under mixed precision the gradients reach their f32 leaves as partial sums (the bf16 ->
//! f32 conversion of the compute copy's gradient is exact, so it keeps them partial), so the
//! buckets reduce them in f32 unless `wire` says otherwise.

use std::sync::{Arc, Mutex};

use oxiflow_dtype::DType;
use oxiflow_placement::Placement;
use oxiflow_sbp::{ReduceOp, Sbp};
use oxiflow_tensor::{
    bucket_fits, start_bucket, BucketTarget, GradReadyHook, PendingBucket, Tensor,
};

use super::Zero;
use crate::nn::Parameter;
use crate::Result;

/// What the hook does with the gradients it takes.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum SyncMode {
    /// Keep them as local partial sums (a part of the batch that is not the last).
    Defer,
    /// Reduce them in buckets as they become final.
    Reduce,
}

/// One bucket's reduction.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct BucketLaunch {
    /// Gradients in the bucket.
    pub tensors: usize,
    /// Their logical bytes (the same on every rank).
    pub bytes: usize,
    pub target: BucketTarget,
    /// The dtype the bucket moved as, when not the gradients' own.
    pub wire: Option<DType>,
    /// Launched while the walk still ran (the bucket filled up), not when it ended.
    pub during_walk: bool,
}

struct Open {
    dtype: DType,
    placement: Placement,
    target: BucketTarget,
    leaves: Vec<Tensor>,
    bytes: usize,
}

#[derive(Default)]
struct State {
    open: Vec<Open>,
    /// Launched buckets whose results are not cut into the leaves' gradients yet.
    pending: Vec<(Vec<Tensor>, PendingBucket)>,
    launched: Vec<BucketLaunch>,
}

/// The mesh axis gradient buckets reduce over: `zero`'s data-parallel axis, or, where that
/// holds a single rank and ZeRO is off, the first axis of more than one rank on which every
/// parameter is broadcast (a context-parallel one, over which the gradients arrive as partial
/// sums).
fn sync_axis(params: &[Parameter], zero: &Zero) -> usize {
    let Some(placement) = params.first().and_then(|p| p.value().placement().cloned()) else {
        return zero.axis();
    };
    let shape = placement.shape();
    if zero.stage() > 0 || shape.get(zero.axis()).is_some_and(|&n| n > 1) {
        return zero.axis();
    }
    let everywhere_b = |a: usize| {
        params.iter().all(|p| {
            p.value()
                .nd_sbp()
                .is_some_and(|nd| nd.as_slice().get(a) == Some(&Sbp::B))
        })
    };
    (0..shape.len())
        .find(|&a| shape[a] > 1 && everywhere_b(a))
        .unwrap_or(zero.axis())
}

/// The bucketed reduction of one backward pass (see the module's doc).
pub struct GradBuckets {
    leaves: Vec<Tensor>,
    /// The mesh axis the buckets reduce over (see [`sync_axis`]).
    axis: usize,
    cap_bytes: usize,
    mode: SyncMode,
    wire: Option<DType>,
    state: Mutex<State>,
}

impl GradBuckets {
    /// The hook for `params`' current leaves, the data-parallel axis and stage of `zero`, and
    /// buckets of at least `cap_bytes` (1 byte: one gradient per bucket), each moving as `wire`
    /// (None: the gradients' own dtype).
    pub fn new(
        params: &[Parameter],
        zero: Zero,
        cap_bytes: usize,
        mode: SyncMode,
        wire: Option<DType>,
    ) -> Arc<Self> {
        let axis = sync_axis(params, &zero);
        let leaves = params
            .iter()
            .filter(|p| {
                p.keeps_gathered()
                    || p.value().nd_sbp().and_then(|nd| nd.as_slice().get(axis)) == Some(&Sbp::B)
            })
            .map(Parameter::value)
            .collect();
        Arc::new(GradBuckets {
            leaves,
            axis,
            cap_bytes: cap_bytes.max(1),
            mode,
            wire,
            state: Mutex::new(State::default()),
        })
    }

    /// The buckets reduced so far, in launch order.
    pub fn launched(&self) -> Vec<BucketLaunch> {
        self.lock().launched.clone()
    }

    /// Reduces now, in buckets in reverse parameter order, every taken gradient still a partial
    /// sum (after a walk in `Defer` mode, e.g. the pipeline's micro-batches).
    pub fn reduce_now(&self) -> Result<()> {
        for leaf in self.leaves.iter().rev() {
            self.add(leaf)?;
        }
        self.flush()
    }

    fn lock(&self) -> std::sync::MutexGuard<'_, State> {
        self.state.lock().unwrap_or_else(|e| e.into_inner())
    }

    /// Puts `leaf`'s gradient in its open bucket, launching the bucket when it is full.
    fn add(&self, leaf: &Tensor) -> Result<()> {
        let axis = self.axis;
        let Some(g) = leaf.grad() else {
            return Ok(());
        };
        let (Some(nd), Some(placement)) = (g.nd_sbp(), g.placement()) else {
            return Ok(());
        };
        if nd.as_slice().get(axis) != Some(&Sbp::Partial(ReduceOp::Sum))
            || placement.shape().get(axis) == Some(&1)
        {
            // Not a partial sum here, or one over a single rank (the optimizer relabels it).
            return Ok(());
        }
        let into_shard = leaf
            .autograd()
            .grad_layout()
            .is_some_and(|nd| nd.as_slice().get(axis).is_some_and(|s| s.is_split()));
        let target = match into_shard {
            true => BucketTarget::Shard,
            false => BucketTarget::Broadcast,
        };
        if !bucket_fits(&g, axis, target) {
            // Boxed alone, to the leaf's grad layout when it has one.
            let to = leaf
                .autograd()
                .grad_layout()
                .unwrap_or_else(|| nd.with_axis(axis, target_sbp(target)));
            leaf.autograd().set_grad(Some(g.to_global(placement, to)?));
            return Ok(());
        }
        let bytes = g.numel() * g.dtype().size();
        let full = {
            let mut st = self.lock();
            let at = match st.open.iter().position(|o| {
                o.dtype == g.dtype() && o.placement.same_as(placement) && o.target == target
            }) {
                Some(at) => at,
                None => {
                    st.open.push(Open {
                        dtype: g.dtype(),
                        placement: placement.clone(),
                        target,
                        leaves: Vec::new(),
                        bytes: 0,
                    });
                    st.open.len() - 1
                }
            };
            let open = &mut st.open[at];
            open.leaves.push(leaf.clone());
            open.bytes += bytes;
            (open.bytes >= self.cap_bytes).then(|| st.open.remove(at))
        };
        match full {
            Some(b) => self.launch(b, true),
            None => Ok(()),
        }
    }

    /// Launches every open bucket, oldest first, then gives every launched bucket's leaves
    /// their reduced gradients (on devices the compute stream waits for each collective only
    /// here, so the backward kernels queued after a launch run under it).
    fn flush(&self) -> Result<()> {
        let open = std::mem::take(&mut self.lock().open);
        for b in open {
            self.launch(b, false)?;
        }
        let pending = std::mem::take(&mut self.lock().pending);
        for (leaves, bucket) in pending {
            for (leaf, g) in leaves.iter().zip(bucket.finish()?) {
                leaf.autograd().set_grad(Some(g));
            }
        }
        Ok(())
    }

    fn launch(&self, b: Open, during_walk: bool) -> Result<()> {
        let (leaves, grads): (Vec<Tensor>, Vec<Tensor>) = b
            .leaves
            .iter()
            .filter_map(|l| Some((l.clone(), l.grad()?)))
            .unzip();
        let wire = self.wire.filter(|&w| w != b.dtype);
        let pending = start_bucket(&grads, self.axis, b.target, wire)?;
        tracing::debug!(
            tensors = b.leaves.len(),
            bytes = b.bytes,
            target = ?b.target,
            during_walk,
            "gradient bucket reduced"
        );
        let mut st = self.lock();
        st.pending.push((leaves, pending));
        st.launched.push(BucketLaunch {
            tensors: b.leaves.len(),
            bytes: b.bytes,
            target: b.target,
            wire,
            during_walk,
        });
        Ok(())
    }
}

fn target_sbp(target: BucketTarget) -> Sbp {
    match target {
        BucketTarget::Broadcast => Sbp::B,
        BucketTarget::Shard => Sbp::S(0),
    }
}

impl GradReadyHook for GradBuckets {
    fn takes(&self, leaf: &Tensor) -> bool {
        self.leaves.iter().any(|l| l.same(leaf))
    }
    fn ready(&self, leaf: &Tensor) -> Result<()> {
        match self.mode {
            SyncMode::Defer => Ok(()),
            SyncMode::Reduce => self.add(leaf),
        }
    }
    fn finish(&self) -> Result<()> {
        match self.mode {
            SyncMode::Defer => Ok(()),
            SyncMode::Reduce => self.flush(),
        }
    }
}
