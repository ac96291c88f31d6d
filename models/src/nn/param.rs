//! `Parameter` (a named, replaceable leaf tensor, trainable or frozen), the `Module` trait and
//! `ParamRegistry`.

use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Mutex, RwLock};

use crate::shape_error::pair_shape_err;
use crate::{Result, TensorError};
use oxiflow_dtype::{DType, MatmulPrecision, MixedPrecision};
use oxiflow_sbp::NdSbp;
use oxiflow_tensor::Tensor;

struct ParamInner {
    name: String,
    value: RwLock<Tensor>,
    /// The layout layers compute with, when the stored leaf is sharded (ZeRO-3).
    compute: RwLock<Option<NdSbp>>,
    /// The dtype layers compute with, when it differs from the stored leaf's (mixed
    /// precision: an f32 master leaf computed with as bf16), and the precision of the f32
    /// products that read it (the policy's, an attribute of those products' ops).
    compute_dtype: RwLock<(Option<DType>, MatmulPrecision)>,
    /// The layout the leaf's gradient is boxed to as it accumulates (ZeRO-2 and 3).
    grad_layout: RwLock<Option<NdSbp>>,
    /// A gather issued ahead of use (`prefetch`): the leaf it was gathered from, whether
    /// autograd recorded the gather, and the gathered value; taken by the next `compute`.
    prefetched: Mutex<Option<(Tensor, bool, Tensor)>>,
    /// The leaf's copy in the compute dtype written with it (`set_value_with_copy`: the
    /// optimizer's update), with the leaf it is a copy of: current while that leaf is the
    /// stored one.
    copy: Mutex<Option<(Tensor, Tensor)>>,
    /// Whether the leaf is a master shard whose compute copy is kept gathered between steps
    /// (`store_master_shard`).
    keeps_gathered: AtomicBool,
    /// Whether the parameter is frozen (`freeze`): its leaf wants no gradient.
    frozen: AtomicBool,
    /// The compute copy all-gathered into the compute layout (`ensure_gathered`), with the
    /// leaf it is a copy of: current while that leaf is the stored one.
    gathered: Mutex<Option<(Tensor, Tensor)>>,
}

/// A named trainable tensor. Cloning shares it. Tensors are values, so an update replaces
/// the leaf (`set_value`; an optimizer may write the new value over the old one's memory where
/// nothing else holds it, see [`Parameter::leaf_memory_free_for`]); layers read the current value on every forward through
/// [`Parameter::compute`], which all-gathers a sharded leaf (ZeRO-3) into the layout the layer
/// computes with; the gather's backward reduce-scatters the gradient into the shard.
#[derive(Clone)]
pub struct Parameter(Arc<ParamInner>);

impl Parameter {
    /// A parameter holding `value` (detached, marked `requires_grad`).
    pub fn new(name: impl Into<String>, value: &Tensor) -> Parameter {
        Parameter(Arc::new(ParamInner {
            name: name.into(),
            value: RwLock::new(value.detach().requires_grad_(true)),
            compute: RwLock::new(None),
            compute_dtype: RwLock::new((None, MatmulPrecision::F32)),
            grad_layout: RwLock::new(None),
            prefetched: Mutex::new(None),
            copy: Mutex::new(None),
            keeps_gathered: AtomicBool::new(false),
            frozen: AtomicBool::new(false),
            gathered: Mutex::new(None),
        }))
    }
    pub fn name(&self) -> &str {
        &self.0.name
    }
    /// Freezes the parameter: its leaf (and every later one) wants no gradient, so a backward
    /// pass computes and stores none for it, and optimizers are built without it
    /// ([`Module::trainable_parameters`]).
    pub fn freeze(&self) {
        self.0.frozen.store(true, Ordering::Relaxed);
        let mut v = self.0.value.write().unwrap_or_else(|e| e.into_inner());
        *v = v.detach().requires_grad_(false);
    }
    /// Whether the parameter is frozen ([`Parameter::freeze`]).
    pub fn is_frozen(&self) -> bool {
        self.0.frozen.load(Ordering::Relaxed)
    }
    /// A new leaf of `t`'s values, wanting a gradient unless the parameter is frozen.
    fn leaf(&self, t: &Tensor) -> Tensor {
        t.detach().requires_grad_(!self.is_frozen())
    }
    /// The value in the layout layers compute with: the leaf itself, or the leaf all-gathered
    /// from its shards (recorded by autograd) when it is stored sharded; for a master shard
    /// ([`Parameter::store_master_shard`]) its kept gathered copy, with autograd recording
    /// the cast it stands for (no kernel, no communication): the leaf's gradient arrives as
    /// the whole partial sum cast back to the leaf's dtype, which its grad layout (ZeRO-2's
    /// shard) or a gradient bucket reduce-scatters.
    pub fn compute(&self) -> Result<Tensor> {
        let v = self.value();
        if let Some(full) = self.ensure_gathered()? {
            return v.cast_boxed_as_copy(&full);
        }
        let ahead = self
            .0
            .prefetched
            .lock()
            .unwrap_or_else(|e| e.into_inner())
            .take();
        if let Some((leaf, recorded, gathered)) = ahead {
            if leaf.same(&v) && recorded == oxiflow_tensor::is_grad_enabled() {
                return Ok(gathered);
            }
        }
        self.gather(v)
    }
    /// Issues the all-gather of a sharded leaf now, ahead of the `compute` that will use it
    /// (which then takes it instead of gathering again): on devices the gather runs on the
    /// communication stream while the compute stream works on the layer before. Returns the
    /// gathered value; None (and nothing done) when the leaf is not stored sharded. Every rank
    /// must call it alike. A prefetch whose leaf was replaced since (an optimizer step), or that
    /// was made in another autograd mode than the `compute`, is not used.
    pub fn prefetch(&self) -> Result<Option<Tensor>> {
        if self.keeps_gathered() {
            return self.ensure_gathered();
        }
        if self.compute_layout().is_none() {
            return Ok(None);
        }
        let v = self.value();
        let gathered = self.gather(v.clone())?;
        *self.0.prefetched.lock().unwrap_or_else(|e| e.into_inner()) =
            Some((v, oxiflow_tensor::is_grad_enabled(), gathered.clone()));
        Ok(Some(gathered))
    }
    /// The leaf as layers compute with it: cast to the compute dtype (before the gather, so a
    /// sharded leaf moves its 16-bit copy), then gathered into the compute layout. Both steps
    /// are recorded by autograd, so the gradient arrives at the leaf in its own dtype and
    /// layout. The cast is the copy the optimizer wrote with this leaf when there is one
    /// (`Tensor::cast_as_copy`: no kernel), else a cast kernel.
    fn gather(&self, v: Tensor) -> Result<Tensor> {
        let v = match self.compute_dtype() {
            d if d != v.dtype() => match self.current_copy(&v, d) {
                Some(c) => v.cast_as_copy(&c)?,
                None => v.to_dtype(d)?,
            },
            _ => v,
        };
        let compute = self
            .0
            .compute
            .read()
            .unwrap_or_else(|e| e.into_inner())
            .clone();
        match (compute, v.placement()) {
            (Some(nd), Some(p)) => Ok(v.to_global(p, nd)?),
            _ => Ok(v),
        }
    }
    /// The copy of `leaf` in `dtype` written with it, when `leaf` is the one it was written
    /// with (any other leaf, e.g. one set by `set_value`, has none).
    fn current_copy(&self, leaf: &Tensor, dtype: DType) -> Option<Tensor> {
        let g = self.0.copy.lock().unwrap_or_else(|e| e.into_inner());
        match &*g {
            Some((of, c)) if of.same(leaf) && c.dtype() == dtype => Some(c.clone()),
            _ => None,
        }
    }
    /// Makes layers compute with this parameter as `precision` says (its `compute` dtype, its
    /// products at its `matmul` precision), or a typed error, changing nothing, when the leaf
    /// is not in its `param` dtype (a frozen leaf may be stored in the compute dtype:
    /// [`Parameter::store_frozen_in_compute_dtype`]). The stored leaf, its gradient and the
    /// optimizer's state keep the leaf's dtype.
    pub fn set_precision(&self, precision: &MixedPrecision) -> Result<()> {
        self.check_precision(precision)?;
        *self
            .0
            .compute_dtype
            .write()
            .unwrap_or_else(|e| e.into_inner()) = (Some(precision.compute()), precision.matmul());
        Ok(())
    }
    /// The precision of the f32 products layers compute with this parameter (the policy's,
    /// f32 until [`Parameter::set_precision`]).
    pub fn matmul_precision(&self) -> MatmulPrecision {
        self.0
            .compute_dtype
            .read()
            .unwrap_or_else(|e| e.into_inner())
            .1
    }
    /// A typed error when the leaf is in neither `precision`'s `param` dtype nor, frozen, its
    /// `compute` dtype.
    fn check_precision(&self, precision: &MixedPrecision) -> Result<()> {
        let leaf = self.value();
        let d = leaf.dtype();
        if d == precision.param() || (self.is_frozen() && d == precision.compute()) {
            return Ok(());
        }
        Err(TensorError::DType {
            op: "Parameter::set_precision",
            dtypes: d.to_string(),
            shapes: leaf.shape().to_string(),
            sbps: format!("{:?}", leaf.nd_sbp()),
            detail: format!(
                "parameter {} is {d}, not the master weights' dtype of the policy ({precision})",
                self.name()
            ),
        })
    }
    /// Makes layers compute with this parameter as `dtype` (None: the leaf's own dtype). The
    /// stored leaf, its gradient and the optimizer's state keep the leaf's dtype.
    pub fn set_compute_dtype(&self, dtype: Option<DType>) {
        self.0
            .compute_dtype
            .write()
            .unwrap_or_else(|e| e.into_inner())
            .0 = dtype;
    }
    /// Stores a frozen parameter's leaf in its compute dtype: nothing updates it, so no master
    /// copy is needed (a frozen base under bf16 mixed precision holds 16-bit weights only).
    /// A trainable parameter, or one computing in its own dtype, is left as it is.
    pub fn store_frozen_in_compute_dtype(&self) -> Result<()> {
        let d = self.compute_dtype();
        let leaf = self.value();
        if !self.is_frozen() || leaf.dtype() == d {
            return Ok(());
        }
        let cast = {
            let _ng = oxiflow_tensor::no_grad();
            leaf.detach().to_dtype(d)?
        };
        self.drop_copy();
        *self.0.value.write().unwrap_or_else(|e| e.into_inner()) = self.leaf(&cast);
        Ok(())
    }
    /// The dtype [`Parameter::compute`] gives.
    pub fn compute_dtype(&self) -> DType {
        let d = self
            .0
            .compute_dtype
            .read()
            .unwrap_or_else(|e| e.into_inner())
            .0;
        d.unwrap_or_else(|| self.value().dtype())
    }
    /// The layout [`Parameter::compute`] gathers into, when the leaf is stored sharded.
    pub fn compute_layout(&self) -> Option<NdSbp> {
        self.0
            .compute
            .read()
            .unwrap_or_else(|e| e.into_inner())
            .clone()
    }
    /// Stores the leaf in `storage` (e.g. split over the data-parallel axis) and keeps its
    /// current layout as the one layers compute with. The leaf's gradient then arrives in the
    /// storage layout. Runs a collective when `storage` is not a slice of the current layout;
    /// every rank must call it alike.
    pub fn store_sharded(&self, storage: NdSbp) -> Result<()> {
        let v = self.value();
        let (Some(p), Some(cur)) = (v.placement().cloned(), v.nd_sbp().cloned()) else {
            return Err(TensorError::Autograd {
                op: "Parameter::store_sharded",
                detail: format!("parameter {} is not global: {}", self.name(), v.describe()),
            });
        };
        if cur == storage {
            return Ok(());
        }
        let stored = {
            let _ng = oxiflow_tensor::no_grad();
            v.to_global(&p, storage)?
        };
        let compute = self.compute_layout().unwrap_or(cur);
        *self.0.compute.write().unwrap_or_else(|e| e.into_inner()) = Some(compute);
        *self.0.value.write().unwrap_or_else(|e| e.into_inner()) = self.leaf(&stored);
        self.apply_grad_layout()
    }
    /// Stores the leaf in `storage` as [`Parameter::store_sharded`] does, as the master shard
    /// of a value layers compute with through a copy in the compute dtype gathered into the
    /// compute layout once per leaf and kept until the leaf is replaced
    /// ([`Parameter::ensure_gathered`]), rather than gathered at every use: ZeRO-2 under
    /// mixed precision, where the gathered copy is 16-bit and the f32 leaf a shard. Every rank
    /// must call it alike.
    pub fn store_master_shard(&self, storage: NdSbp) -> Result<()> {
        self.store_sharded(storage)?;
        self.0.keeps_gathered.store(true, Ordering::Relaxed);
        Ok(())
    }
    /// Whether the leaf is a master shard ([`Parameter::store_master_shard`]).
    pub fn keeps_gathered(&self) -> bool {
        self.0.keeps_gathered.load(Ordering::Relaxed)
    }
    /// For a master shard: the stored leaf's compute copy gathered into the compute layout,
    /// issued now where the leaf has none yet (after a cast where it has no compute copy
    /// either) and kept until the leaf is replaced; None, and nothing done, for any other
    /// parameter. Runs untracked by autograd (`compute` records it). Every rank must call it
    /// alike.
    pub fn ensure_gathered(&self) -> Result<Option<Tensor>> {
        if !self.keeps_gathered() {
            return Ok(None);
        }
        let leaf = self.value();
        if let Some(full) = self.gathered_copy_of(&leaf) {
            return Ok(Some(full));
        }
        let copy = self.ensure_compute_copy()?.unwrap_or_else(|| leaf.detach());
        let full = {
            let _ng = oxiflow_tensor::no_grad();
            match (self.compute_layout(), leaf.placement()) {
                (Some(nd), Some(p)) => copy.to_global(p, nd)?,
                _ => copy,
            }
        };
        *self.0.gathered.lock().unwrap_or_else(|e| e.into_inner()) = Some((leaf, full.clone()));
        Ok(Some(full))
    }
    /// The stored leaf's gathered copy in the compute dtype (see
    /// [`Parameter::ensure_gathered`]), when it has one; communicates nothing.
    pub fn gathered_copy(&self) -> Option<Tensor> {
        self.gathered_copy_of(&self.value())
    }
    /// The gathered copy of `leaf` in the compute dtype, when it has one.
    fn gathered_copy_of(&self, leaf: &Tensor) -> Option<Tensor> {
        let dtype = self.compute_dtype();
        let g = self.0.gathered.lock().unwrap_or_else(|e| e.into_inner());
        match &*g {
            Some((of, full)) if of.same(leaf) && full.dtype() == dtype => Some(full.clone()),
            _ => None,
        }
    }
    /// Boxes the leaf's gradient to `nd` as it accumulates (also for every later leaf).
    pub fn set_grad_layout(&self, nd: NdSbp) -> Result<()> {
        *self
            .0
            .grad_layout
            .write()
            .unwrap_or_else(|e| e.into_inner()) = Some(nd);
        self.apply_grad_layout()
    }
    fn apply_grad_layout(&self) -> Result<()> {
        let nd = self
            .0
            .grad_layout
            .read()
            .unwrap_or_else(|e| e.into_inner())
            .clone();
        match nd {
            Some(nd) => Ok(self.value().set_grad_layout(nd)?),
            None => Ok(()),
        }
    }
    /// The stored leaf (requires grad); sharded when the parameter is stored sharded.
    pub fn value(&self) -> Tensor {
        self.0
            .value
            .read()
            .unwrap_or_else(|e| e.into_inner())
            .clone()
    }
    /// The gradient accumulated into the current value.
    pub fn grad(&self) -> Option<Tensor> {
        self.value().grad()
    }
    pub fn zero_grad(&self) {
        self.value().zero_grad()
    }
    /// Replaces the value by `t` (same shape, dtype and layout); the new leaf has no gradient.
    /// Layers compute with it through a cast (any copy of the old leaf is dropped).
    pub fn set_value(&self, t: &Tensor) -> Result<()> {
        self.set_value_with_copy(t, None)
    }
    /// [`Parameter::set_value`] with `copy`, the new value already cast to the compute dtype
    /// (bit for bit what the cast gives; e.g. written by the optimizer's update): layers then
    /// compute with it instead of casting, while this leaf is the stored one. A copy of
    /// another shape or layout is a typed error.
    pub fn set_value_with_copy(&self, t: &Tensor, copy: Option<&Tensor>) -> Result<()> {
        self.drop_copy();
        if let Some(c) = copy {
            if c.shape() != t.shape() || c.layout() != t.layout() || !c.dtype().is_float() {
                return Err(pair_shape_err(
                    "Parameter::set_value_with_copy",
                    t,
                    c,
                    format!(
                        "parameter {}: {} is not a copy of {}",
                        self.name(),
                        c.describe(),
                        t.describe()
                    ),
                ));
            }
        }
        let cur = self.value();
        if t.shape() != cur.shape() || t.dtype() != cur.dtype() || t.layout() != cur.layout() {
            return Err(pair_shape_err(
                "Parameter::set_value",
                &cur,
                t,
                format!(
                    "parameter {} is {} but the new value is {}",
                    self.name(),
                    cur.describe(),
                    t.describe()
                ),
            ));
        }
        let leaf = self.leaf(t);
        *self.0.value.write().unwrap_or_else(|e| e.into_inner()) = leaf.clone();
        if let Some(c) = copy {
            *self.0.copy.lock().unwrap_or_else(|e| e.into_inner()) = Some((leaf, c.detach()));
        }
        self.apply_grad_layout()
    }
    /// The stored leaf's copy in the compute dtype that layers compute with instead of a cast,
    /// when it has one (see [`Parameter::set_value_with_copy`]).
    pub fn compute_copy(&self) -> Option<Tensor> {
        self.current_copy(&self.value(), self.compute_dtype())
    }
    /// The stored leaf's copy in the compute dtype, made now by a cast when it has none (and
    /// kept as [`Parameter::set_value_with_copy`] keeps one); None when layers compute in the
    /// leaf's own dtype. A compiled step reads it as an input, so its program casts nothing.
    pub fn ensure_compute_copy(&self) -> Result<Option<Tensor>> {
        let leaf = self.value();
        let d = self.compute_dtype();
        if d == leaf.dtype() {
            return Ok(None);
        }
        if let Some(c) = self.current_copy(&leaf, d) {
            return Ok(Some(c));
        }
        let c = {
            let _ng = oxiflow_tensor::no_grad();
            leaf.detach().to_dtype(d)?
        };
        *self.0.copy.lock().unwrap_or_else(|e| e.into_inner()) = Some((leaf, c.clone()));
        Ok(Some(c))
    }
    /// Whether an update may write over `view`'s memory: `view` is the caller's update view
    /// of this parameter (a handle of the stored leaf, a tensor over its memory, or a shard of
    /// its own), and nothing but it and this parameter's own handles of the leaf refers to that
    /// memory (see [`Tensor::data_held_only_by`]). A pending prefetch holds the leaf, so it
    /// keeps the leaf's memory as it is.
    pub fn leaf_memory_free_for(&self, view: &Tensor) -> bool {
        let value = self.0.value.read().unwrap_or_else(|e| e.into_inner());
        if !view.shares_piece(&value) {
            return Tensor::data_held_only_by(&[view]);
        }
        let copy = self.0.copy.lock().unwrap_or_else(|e| e.into_inner());
        let gathered = self.0.gathered.lock().unwrap_or_else(|e| e.into_inner());
        let mut handles = vec![&*value, view];
        for kept in [&*copy, &*gathered] {
            handles.extend(kept.as_ref().map(|(of, _)| of).filter(|of| of.same(&value)));
        }
        Tensor::data_held_only_by(&handles)
    }
    /// The current compute copy (see [`Parameter::compute_copy`]) when nothing but this
    /// parameter refers to its memory, so an update may write the next copy over it.
    pub fn copy_memory_free(&self) -> Option<Tensor> {
        // The copy's two handles: the parameter's, and the one `compute_copy` gives.
        self.compute_copy()
            .filter(|c| Tensor::data_held_only_by(&[c, c]))
    }
    /// Drops the compute copy and its gathered copy (their memory), e.g. before an update
    /// writes the next one.
    pub fn drop_copy(&self) {
        *self.0.copy.lock().unwrap_or_else(|e| e.into_inner()) = None;
        *self.0.gathered.lock().unwrap_or_else(|e| e.into_inner()) = None;
    }
}

impl std::fmt::Debug for Parameter {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "Parameter({}: {})", self.name(), self.value().describe())
    }
}

/// Anything with parameters.
pub trait Module {
    /// The parameters, in a fixed order, with unique names.
    fn parameters(&self) -> Vec<Parameter>;
    /// The parameters that train (not frozen), in `parameters()` order: what optimizers update
    /// and checkpoints save.
    fn trainable_parameters(&self) -> Vec<Parameter> {
        self.parameters()
            .into_iter()
            .filter(|p| !p.is_frozen())
            .collect()
    }
    /// A registry of the parameters (fails on duplicate names).
    fn registry(&self) -> Result<ParamRegistry> {
        ParamRegistry::new(self.parameters())
    }
    /// Gathers every parameter stored sharded (ZeRO-3) ahead of use; see
    /// [`Parameter::prefetch`].
    fn prefetch(&self) -> Result<()> {
        for p in self.parameters() {
            p.prefetch()?;
        }
        Ok(())
    }
    /// Gives every parameter the precision policy (see [`Parameter::set_precision`]): layers
    /// compute in its `compute` dtype over master weights in its `param` dtype. Checks every
    /// parameter before changing any.
    fn set_precision(&self, precision: &MixedPrecision) -> Result<()> {
        let params = self.parameters();
        params
            .iter()
            .try_for_each(|p| p.check_precision(precision))?;
        params.iter().try_for_each(|p| p.set_precision(precision))
    }
    /// Clears every parameter's gradient.
    fn zero_grad(&self) {
        for p in self.parameters() {
            p.zero_grad();
        }
    }
}

/// Named parameters in registration order: what optimizers update and checkpoints save.
#[derive(Clone, Debug, Default)]
pub struct ParamRegistry {
    params: Vec<Parameter>,
}

impl ParamRegistry {
    /// A registry; names must be unique.
    pub fn new(params: Vec<Parameter>) -> Result<ParamRegistry> {
        let mut r = ParamRegistry::default();
        for p in params {
            r.add(p)?;
        }
        Ok(r)
    }
    pub fn add(&mut self, p: Parameter) -> Result<()> {
        if self.get(p.name()).is_some() {
            return Err(TensorError::Autograd {
                op: "ParamRegistry::add",
                detail: format!("duplicate parameter name {}", p.name()),
            });
        }
        self.params.push(p);
        Ok(())
    }
    pub fn get(&self, name: &str) -> Option<&Parameter> {
        self.params.iter().find(|p| p.name() == name)
    }
    pub fn params(&self) -> &[Parameter] {
        &self.params
    }
    pub fn len(&self) -> usize {
        self.params.len()
    }
    pub fn is_empty(&self) -> bool {
        self.params.is_empty()
    }
    /// Total number of (logical) elements.
    pub fn numel(&self) -> usize {
        self.params.iter().map(|p| p.value().numel()).sum()
    }
}
