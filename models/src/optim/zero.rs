//! ZeRO as layouts: how far the optimizer shards its state, the gradients and the parameters
//! over the data-parallel mesh axis. Stage 1 keeps optimizer state split S(0) on that axis and
//! updates each parameter on its shard (the gradient is all-reduced, then sliced; the new
//! parameter is all-gathered); stage 2 also boxes each gradient straight from its partial sum to
//! the shard as backward accumulates it (a reduce-scatter instead of an all-reduce, and 1/dp of
//! the gradient memory); stage 3 also stores the parameters split, and layers all-gather them
//! at use (`Parameter::compute`), the gather's backward reduce-scattering the gradient. Under
//! mixed precision stages 1 and 2 keep f32 master shards, as DeepSpeed does: the update writes each
//! shard's 16-bit copy, which is gathered once per step and kept whole for the passes, and the
//! gradient reaches the shard as a whole leaf's does (the f32 partial sum; stage 1 all-reduces
//! it and updates its shard's slice, stage 2 reduce-scatters it into the shard alone or in
//! buckets), so the steps are DP's bit for bit.

use oxiflow_placement::{AxisRole, NamedMesh};
use oxiflow_sbp::{NdSbp, Sbp};
use oxiflow_tensor::Tensor;

use crate::nn::Parameter;
use crate::{Result, TensorError};

/// ZeRO stage (0: off, 1, 2, 3), the data-parallel mesh axis it shards over, and the size of
/// the buckets that gather updated shards back into the parameters under stages 1 and 2.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct Zero {
    stage: u8,
    axis: usize,
    gather_bytes: usize,
}

/// The default size of a bucket of updated shards gathered by one collective: 0, one
/// all-gather per parameter. Each then writes the parameter's own new memory (no copies) on
/// the communication stream, and the next forward pass waits only where it first reads that
/// parameter, so the gathers overlap it. On two H100s over NVLink this beat 25 MiB buckets,
/// whose copy into and out of the gathered rows runs on the compute stream (see
/// BENCHMARKS.md); buckets issue fewer collectives, for many small parameters or slow links.
pub const DEFAULT_GATHER_BYTES: usize = 0;

impl Zero {
    /// No sharding: state, gradients and parameters in the parameters' layouts.
    pub const OFF: Zero = Zero {
        stage: 0,
        axis: 0,
        gather_bytes: 0,
    };

    /// Stage `stage` (0..=3) over mesh axis `axis`, gathering updated shards as
    /// [`DEFAULT_GATHER_BYTES`] says.
    pub fn new(stage: u8, axis: usize) -> Result<Zero> {
        if stage > 3 {
            return Err(TensorError::Autograd {
                op: "Zero::new",
                detail: format!("ZeRO stage must be 0, 1, 2 or 3, got {stage}"),
            });
        }
        Ok(Zero {
            stage,
            axis,
            gather_bytes: DEFAULT_GATHER_BYTES,
        })
    }

    /// Stage `stage` over the axis of `mesh` that shards the parameters (refused for a stage
    /// above 0 on a mesh without one).
    pub fn over(stage: u8, mesh: &NamedMesh) -> Result<Zero> {
        match mesh.axis(AxisRole::Params) {
            Some(axis) => Zero::new(stage, axis),
            None if stage == 0 => Ok(Zero::OFF),
            None => Err(TensorError::Autograd {
                op: "Zero::over",
                detail: format!(
                    "ZeRO stage {stage} needs a mesh axis that shards the parameters; the mesh \
                     {mesh} has none"
                ),
            }),
        }
    }

    /// Gathers the updated shards of stages 1 and 2 back into the parameters in buckets of at
    /// least `bytes` (one all-gather per bucket, [`oxiflow_tensor::gather_bucket`]); 0: one
    /// gather per parameter.
    pub fn with_gather_bytes(mut self, bytes: usize) -> Zero {
        self.gather_bytes = bytes;
        self
    }
    pub fn gather_bytes(&self) -> usize {
        self.gather_bytes
    }
    pub fn stage(&self) -> u8 {
        self.stage
    }
    pub fn axis(&self) -> usize {
        self.axis
    }

    /// The sharded layout of a parameter laid out `value`: its nd-SBP with the data-parallel
    /// axis split along dim 0 (uneven and empty shards allowed). None when the stage is 0, the
    /// tensor is local or 0-d, or it is not broadcast on that axis (already sharded).
    pub fn shard_layout(&self, value: &Tensor) -> Option<NdSbp> {
        if self.stage == 0 || value.ndim() == 0 {
            return None;
        }
        let nd = value.nd_sbp()?;
        if nd.as_slice().get(self.axis) != Some(&Sbp::B) {
            return None;
        }
        Some(nd.with_axis(self.axis, Sbp::S(0)))
    }

    /// Whether each step's update of a parameter laid out `value` is all-gathered back into
    /// a new leaf (ZeRO-1/2 of a parameter with a shard layout; not a master shard, which is
    /// stored split): its leaf comes from a collective queued after every step, and any
    /// compute copy is cast from it anew.
    pub fn gathers_leaf(&self, value: &Tensor) -> bool {
        matches!(self.stage, 1 | 2) && self.shard_layout(value).is_some()
    }

    /// Prepares the parameters for this stage: stage 2 boxes each leaf's gradient to its shard
    /// as it accumulates; stage 3 stores each parameter sharded. Under mixed precision (a
    /// parameter computed in another dtype than its leaf's, set before this call), stages 1
    /// and 2 store the leaf as a master shard whose compute copy is gathered after each update
    /// (`Parameter::store_master_shard`): the update's shard writes its 16-bit copy, and the
    /// gather moves that instead of the f32 leaf, which is never whole. Every rank must call
    /// it alike.
    pub fn prepare(&self, params: &[Parameter]) -> Result<()> {
        for p in params {
            let Some(shard) = self.shard_layout(&p.value()) else {
                continue;
            };
            if self.stage == 3 {
                p.store_sharded(shard.clone())?;
            } else if p.compute_dtype() != p.value().dtype() {
                p.store_master_shard(shard.clone())?;
            }
            if self.stage >= 2 {
                p.set_grad_layout(shard)?;
            }
        }
        Ok(())
    }
}
