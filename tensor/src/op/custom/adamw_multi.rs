//! Multi-tensor AdamW: one op updates every tensor of an optimizer step. AdamW is element-wise,
//! so a rank updates its own pieces of (param, grad, m, v), which share a layout whatever it is
//! (ZeRO shards, tensor-parallel splits, pipeline stages): [`Tensor::adamw_multi`] runs the op
//! on the rank's local pieces and wraps the results back into their global layouts, with no
//! communication. The math is the fused three-pass AdamW's ([`AdamPart`]), element for element:
//! `m = beta1 m + g1 g`, `v = beta2 v + g2 g^2`, `p = decay p - (step m) / (sqrt(inv_bc2 v) +
//! eps)` with the clip factor folded into `g1` and `g2`; on CUDA one launch for every f32
//! tensor (the raw layer's `adamw_multi`), the three passes per tensor elsewhere. A tensor
//! whose layers compute in another dtype (mixed precision) can ask for the new value's copy
//! in it ([`AdamWSlot::compute_copy`]): the same launch writes it on CUDA (bf16 from f32), a
//! cast after the passes elsewhere, the same bits either way; [`Tensor::cast_as_copy`] then
//! stands for the cast of the new value with no kernel, and [`Tensor::cast_boxed_as_copy`] for
//! the cast and gather of a master shard's copy gathered ahead of use. A global-norm clip may also come as
//! a 0-d f64 tensor, the ratio `max_norm / (norm + eps)` computed on the device
//! ([`Tensor::adamw_multi_clipped`]), so an update is queued with nothing read on the host; it
//! gives the same bits as the factor `min(ratio, 1)` folded on the host.

use oxiflow_dtype::DType;
use oxiflow_sbp::{RuleMode, Rules, Shape};

use crate::dispatch::dispatch_multi;
use crate::op::custom::AdamPart;
use crate::op::{
    kernel_err, need_float, no_gradient, Backend, F64Bits, Inferred, KernelBackend, MetaError,
    MetaResult, OpFamily,
};
use crate::tensor::Tensor;
use crate::{Result, TensorError};

/// One AdamW step over several tensors: inputs (p, g, m, v) per tensor, in that order; outputs
/// (p, m, v) per tensor, then the new value of each tensor with a `copies` dtype cast to it,
/// in tensor order. The coefficients are computed in f64 and rounded to the data's dtype by the
/// kernels, as [`AdamPart`]'s are.
#[derive(Clone, Debug, PartialEq, Eq, Hash)]
pub struct AdamWMulti {
    /// `m = beta1 m + g1 g`.
    pub beta1: F64Bits,
    pub g1: F64Bits,
    /// `v = beta2 v + g2 g^2`.
    pub beta2: F64Bits,
    pub g2: F64Bits,
    /// `lr / (1 - beta1^t)`.
    pub step: F64Bits,
    /// `1 / (1 - beta2^t)`.
    pub inv_bc2: F64Bits,
    pub eps: F64Bits,
    /// `1 - lr wd` of each tensor.
    pub decay: Vec<F64Bits>,
    /// The dtype each tensor's new value is also written in (None: no copy).
    pub copies: Vec<Option<DType>>,
    /// A last operand, a 0-d f64 clip ratio `r`, scales every gradient by `c = min(r, 1)`
    /// (NaN for a NaN `r`, [`AdamWMulti::ratio_scale`]):
    /// `g1` and `g2` are then the unclipped coefficients, and the kernels use `g1 c` and
    /// `g2 c c` ([`AdamWMulti::with_scale`]).
    pub clipped: bool,
    /// With `clipped`, a NaN ratio leaves every tensor as it was (the new values are the old
    /// ones) instead of a NaN update: a step whose loss or gradients are not finite, made a
    /// NaN ratio on the device, is skipped with nothing read on the host.
    pub skip_nan: bool,
}

/// The hyper-parameters of one AdamW step (as `torch.optim.AdamW`).
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct AdamWHyper {
    pub lr: f64,
    pub beta1: f64,
    pub beta2: f64,
    pub eps: f64,
    /// The step number, 1 for the first step.
    pub step: u64,
    /// Multiplies every gradient (a global-norm clip factor; 1 leaves them as they are).
    pub grad_scale: f64,
}

/// One tensor of a multi-tensor step: the parameter, its gradient and its moments (None before
/// the first step: zeros), all in one layout, and its weight decay.
#[derive(Clone, Copy, Debug)]
pub struct AdamWSlot<'a> {
    pub param: &'a Tensor,
    pub grad: &'a Tensor,
    pub m: Option<&'a Tensor>,
    pub v: Option<&'a Tensor>,
    pub weight_decay: f64,
    /// Also write the new value cast to this dtype ([`AdamWUpdated::copy`]).
    pub compute_copy: Option<DType>,
    /// Write the new values over the old ones ([`AdamWReuse`]); None: into new memory.
    pub reuse: Option<AdamWReuse<'a>>,
}

/// A slot's memory given to its update ([`AdamWSlot::reuse`]): on a CUDA device, outside a
/// capture, the new param, m and v are written over the slot's own (its moments must exist)
/// and the new compute copy over `copy` (the old one, of the copy's dtype and the param's
/// shape and layout); otherwise the update writes new memory, as without it. The results are
/// the same bits either way. Every tensor over the given memory sees the new values: give
/// only memory nothing else holds ([`Tensor::data_held_only_by`]), as an optimizer that
/// updates in place, as torch's does, with no second copy of its state.
#[derive(Clone, Copy, Debug, Default)]
pub struct AdamWReuse<'a> {
    pub copy: Option<&'a Tensor>,
}

/// A tensor's new value and moments, in its slot's layout.
#[derive(Clone, Debug)]
pub struct AdamWUpdated {
    pub param: Tensor,
    pub m: Tensor,
    pub v: Tensor,
    /// `param` cast to the slot's `compute_copy` dtype, bit for bit `param.to_dtype(..)`.
    pub copy: Option<Tensor>,
}

/// Kernels of the multi-tensor AdamW (f32 or f64 operands; each tensor's four of one dtype).
pub trait AdamWMultiKernels: KernelBackend {
    /// `x` = (p, g, m, v) per tensor; `out` = (p, m, v) per tensor, then the copies
    /// ([`AdamWMulti::copy_index`]).
    fn adamw_multi(&self, op: &AdamWMulti, x: &[&Self::Piece], out: &mut [Self::Out])
        -> Result<()>;
}

impl AdamWMulti {
    /// The op of one step of `hyper` for tensors decaying by `weight_decay`, tensor `i` also
    /// written as `copies[i]` (missing entries: no copy).
    pub fn new(hyper: &AdamWHyper, weight_decay: &[f64], copies: &[Option<DType>]) -> AdamWMulti {
        let h = hyper;
        let t = h.step.min(i32::MAX as u64) as i32;
        let (bc1, bc2) = (1.0 - h.beta1.powi(t), 1.0 - h.beta2.powi(t));
        let c = h.grad_scale;
        // (c g)^2 = c^2 g^2: the clip factor folded into the moments' coefficients.
        AdamWMulti {
            beta1: F64Bits::new(h.beta1),
            g1: F64Bits::new((1.0 - h.beta1) * c),
            beta2: F64Bits::new(h.beta2),
            g2: F64Bits::new((1.0 - h.beta2) * c * c),
            step: F64Bits::new(h.lr / bc1),
            inv_bc2: F64Bits::new(1.0 / bc2),
            eps: F64Bits::new(h.eps),
            decay: weight_decay
                .iter()
                .map(|wd| F64Bits::new(1.0 - h.lr * wd))
                .collect(),
            copies: (0..weight_decay.len())
                .map(|i| copies.get(i).copied().flatten())
                .collect(),
            clipped: false,
            skip_nan: false,
        }
    }

    /// The gradients' scale of a clip ratio operand `r`: `min(r, 1)`, and NaN for a NaN `r`
    /// (the clip factor of a non-finite norm, see `clip_ratio` in the models crate).
    pub fn ratio_scale(r: f64) -> f64 {
        if r.is_nan() {
            r
        } else {
            r.min(1.0)
        }
    }

    /// The op with the gradients' scale `c` ([`AdamWMulti::ratio_scale`] of a clipped op's
    /// ratio operand) folded into its coefficients as [`AdamWMulti::new`] folds `grad_scale`,
    /// bit for bit.
    pub fn with_scale(&self, c: f64) -> AdamWMulti {
        AdamWMulti {
            g1: F64Bits::new(self.g1.get() * c),
            g2: F64Bits::new(self.g2.get() * c * c),
            clipped: false,
            ..self.clone()
        }
    }

    /// Number of operands: (p, g, m, v) per tensor, and the clip ratio when `clipped`.
    fn operands(&self) -> usize {
        4 * self.decay.len() + usize::from(self.clipped)
    }

    /// The output index of tensor `i`'s copy, when it has one.
    pub fn copy_index(&self, i: usize) -> Option<usize> {
        self.copies.get(i).copied().flatten()?;
        let before = self.copies[..i].iter().filter(|c| c.is_some()).count();
        Some(3 * self.decay.len() + before)
    }

    /// Number of outputs: (p, m, v) per tensor and the copies.
    fn outputs(&self) -> usize {
        3 * self.decay.len() + self.copies.iter().filter(|c| c.is_some()).count()
    }

    /// The three passes of tensor `i`.
    pub fn parts(&self, i: usize) -> [AdamPart; 3] {
        let decay = self.decay.get(i).copied().unwrap_or(F64Bits::new(1.0));
        [
            AdamPart::Moment1 {
                a: self.beta1,
                b: self.g1,
            },
            AdamPart::Moment2 {
                a: self.beta2,
                b: self.g2,
            },
            AdamPart::Update {
                decay,
                step: self.step,
                inv_bc2: self.inv_bc2,
                eps: self.eps,
            },
        ]
    }

    /// The step of tensors `range` alone, as their three passes (every backend's kernel where
    /// no one-launch kernel serves them); with `keep`, each output (and copy) gets its input's
    /// value instead (a step skipped, [`AdamWMulti::skip_nan`]).
    pub(crate) fn composed<B>(
        &self,
        b: &B,
        range: std::ops::Range<usize>,
        x: &[&B::Piece],
        out: &mut [B::Out],
        keep: bool,
    ) -> Result<()>
    where
        B: Backend + KernelBackend<Out = <B as KernelBackend>::Piece>,
    {
        for i in range {
            let (Some(&[p, g, m, v]), Some([po, mo, vo])) =
                (x.get(4 * i..4 * i + 4), out.get_mut(3 * i..3 * i + 3))
            else {
                return Err(kernel_err(
                    "adamw_multi",
                    format!("no operands for tensor {i}"),
                ));
            };
            if keep {
                b.cast(p, po)?;
                b.cast(m, mo)?;
                b.cast(v, vo)?;
            } else {
                let [m1, m2, up] = self.parts(i);
                b.adam(m1, &[m, g], mo)?;
                b.adam(m2, &[v, g], vo)?;
                b.adam(up, &[p, mo, vo], po)?;
            }
            self.cast_copy(b, i, out)?;
        }
        Ok(())
    }

    /// Whether a clip ratio `r` leaves every tensor as it was ([`AdamWMulti::skip_nan`]).
    pub fn keeps_all(&self, r: f64) -> bool {
        self.clipped && self.skip_nan && r.is_nan()
    }

    /// Writes tensor `i`'s copy (when it has one) by casting its new value, already in `out`.
    pub(crate) fn cast_copy<B>(&self, b: &B, i: usize, out: &mut [B::Out]) -> Result<()>
    where
        B: Backend + KernelBackend<Out = <B as KernelBackend>::Piece>,
    {
        let Some(k) = self.copy_index(i) else {
            return Ok(());
        };
        let (values, copies) = out.split_at_mut(3 * self.decay.len());
        match (values.get(3 * i), copies.get_mut(k - 3 * self.decay.len())) {
            (Some(p), Some(c)) => b.cast(p, c),
            _ => Err(kernel_err(
                "adamw_multi",
                format!("no output for the copy of tensor {i}"),
            )),
        }
    }
}

impl OpFamily for AdamWMulti {
    fn name(&self) -> &'static str {
        "adamw_multi"
    }

    fn arity(&self) -> (usize, usize) {
        let n = self.operands();
        (n.max(1), n.max(1))
    }

    fn infer(&self, s: &[&Shape], d: &[DType], mode: RuleMode) -> MetaResult<Inferred> {
        let mut outs = Vec::with_capacity(3 * self.decay.len());
        let mut dtypes = Vec::with_capacity(outs.capacity());
        let tensors = 4 * self.decay.len();
        if self.clipped && (s[tensors].ndim() != 0 || d[tensors] != DType::F64) {
            return Err(MetaError::Shape(format!(
                "the clip ratio must be a 0-d f64 value, got {} {}",
                d[tensors], s[tensors]
            )));
        }
        let (s, d) = (&s[..tensors], &d[..tensors]);
        for (i, (sh, dt)) in s.chunks(4).zip(d.chunks(4)).enumerate() {
            need_float(dt[0], "a parameter")?;
            if sh.iter().any(|x| *x != sh[0]) || dt.iter().any(|&t| t != dt[0]) {
                return Err(MetaError::Shape(format!(
                    "tensor {i}: param, grad, m and v must have one shape and dtype, got {}",
                    sh.iter()
                        .zip(dt)
                        .map(|(x, t)| format!("{t} {x}"))
                        .collect::<Vec<_>>()
                        .join(", ")
                )));
            }
            outs.extend(std::iter::repeat_n(sh[0].clone(), 3));
            dtypes.extend([dt[0]; 3]);
        }
        for (i, sh) in s.chunks(4).enumerate() {
            if let Some(c) = self.copies.get(i).copied().flatten() {
                need_float(c, "a compute copy")?;
                outs.push(sh[0].clone());
                dtypes.push(c);
            }
        }
        // Element-wise on every tensor: global operands compute whole (the layout-preserving
        // path is `Tensor::adamw_multi`, on local pieces).
        let mut r = Rules::new(mode, outs);
        let n_out = r.out_shapes().len();
        r.push_uniform(self.operands(), n_out, oxiflow_sbp::Sbp::B);
        Ok(Inferred::outputs(r, &dtypes))
    }

    fn run<B: Backend>(&self, b: &B, x: &[&B::Piece], out: &mut [B::Out]) -> Result<()> {
        if x.len() != self.operands() || out.len() != self.outputs() {
            return Err(kernel_err(
                self.name(),
                format!(
                    "{} tensors need {} operands and {} outputs, got {} and {}",
                    self.decay.len(),
                    self.operands(),
                    self.outputs(),
                    x.len(),
                    out.len()
                ),
            ));
        }
        b.adamw_multi(self, x, out)
    }

    no_gradient!("an optimizer update has no gradient");
}

/// A typed error naming slot `i` of the multi-tensor step.
fn slot_err(i: usize, detail: String) -> TensorError {
    TensorError::Shape {
        op: "adamw_multi",
        shapes: String::new(),
        sbps: String::new(),
        detail: format!("tensor {i}: {detail}"),
    }
}

/// A tensor laid out like `like` whose piece is the local tensor `local`'s (shared, not copied).
fn with_piece_of(like: &Tensor, local: &Tensor) -> Result<Tensor> {
    match (like.layout(), like.context(), &local.0.piece) {
        (Some(layout), Some(ctx), Some(piece)) => {
            if layout.local_shape(ctx.rank()).as_ref() != Some(local.shape())
                || local.dtype() != like.dtype()
            {
                return Err(slot_err(
                    0,
                    format!(
                        "piece {} {} does not fit {}",
                        local.dtype(),
                        local.shape(),
                        like.describe()
                    ),
                ));
            }
            Ok(Tensor::global_from_shared(
                Some(piece.clone()),
                layout.clone(),
                like.dtype(),
                ctx.clone(),
            ))
        }
        _ => Ok(local.clone()),
    }
}

/// The compute copy of `param` in `dtype`: laid out like it, holding this rank's piece of
/// the copy the op wrote (`local`; None outside the placement).
fn copy_of(param: &Tensor, local: Option<&Tensor>, dtype: DType) -> Result<Tensor> {
    let piece = local.and_then(|l| l.0.piece.clone());
    match (param.layout(), param.context()) {
        (Some(layout), Some(ctx)) => Ok(Tensor::global_from_shared(
            piece,
            layout.clone(),
            dtype,
            ctx.clone(),
        )),
        _ => local
            .cloned()
            .ok_or_else(|| slot_err(0, "a local tensor's copy is missing".into())),
    }
}

impl Tensor {
    /// This tensor cast to `copy`'s dtype, where `copy` holds exactly those values (the
    /// compute copy AdamW wrote with the update that made this tensor): no kernel runs, and
    /// autograd records the cast of this tensor, so its gradient arrives in its own dtype as
    /// through [`Tensor::to_dtype`]. `copy` must have this tensor's shape and layout (or be
    /// local on its device) and a float dtype.
    pub fn cast_as_copy(&self, copy: &Tensor) -> Result<Tensor> {
        let fits = copy.shape() == self.shape()
            && copy.layout() == self.layout()
            && copy.is_global() == self.is_global()
            && (self.is_global() || copy.device() == self.device())
            && copy.dtype().is_float();
        if !fits {
            return Err(TensorError::Shape {
                op: "cast_as_copy",
                shapes: format!("{}, {}", self.shape(), copy.shape()),
                sbps: format!("{:?}, {:?}", self.nd_sbp(), copy.nd_sbp()),
                detail: format!("{} is not a copy of {}", copy.describe(), self.describe()),
            });
        }
        if copy.dtype() == self.dtype() {
            return Ok(self.clone());
        }
        Ok(self.recorded_cast_to(copy))
    }

    /// `copy` (detached), with autograd recording it as this tensor cast to its dtype.
    fn recorded_cast_to(&self, copy: &Tensor) -> Tensor {
        let out = copy.detach();
        let cast = crate::op::ElementwiseOp::Cast(copy.dtype());
        crate::autograd::record(&cast.into(), &[self], std::slice::from_ref(&out));
        out
    }

    /// This global leaf cast to `copy`'s dtype and boxed to `copy`'s layout, where `copy` is
    /// that result made already (bit for bit what the cast and `to_global` give, e.g. a 16-bit
    /// copy of a master shard gathered ahead of use): `copy` itself, with autograd recording
    /// the cast alone, so the leaf's gradient arrives cast back to its dtype but in the
    /// gradient's own layout (a partial sum, say) for the leaf's grad layout or a bucket to box
    /// (`Tensor::set_grad_layout`, `GradReadyHook`), as a whole leaf's gradient does.
    /// Communicates nothing. A tensor with autograd history, or a `copy` of another shape or
    /// placement or not of a float dtype, is a typed error.
    pub fn cast_boxed_as_copy(&self, copy: &Tensor) -> Result<Tensor> {
        let fits = match (self.placement(), copy.placement(), copy.nd_sbp()) {
            (Some(p), Some(q), Some(_)) => {
                p.same_as(q) && copy.shape() == self.shape() && copy.dtype().is_float()
            }
            _ => false,
        };
        if !fits || !self.is_leaf() {
            return Err(TensorError::Shape {
                op: "cast_boxed_as_copy",
                shapes: format!("{}, {}", self.shape(), copy.shape()),
                sbps: format!("{:?}, {:?}", self.nd_sbp(), copy.nd_sbp()),
                detail: format!(
                    "{} is not a cast and boxing of the leaf {} (both global, one placement and \
                     shape, a float copy)",
                    copy.describe(),
                    self.describe()
                ),
            });
        }
        if copy.dtype() == self.dtype() && copy.nd_sbp() == self.nd_sbp() {
            // The copy is this leaf's own value.
            return Ok(self.clone());
        }
        Ok(self.recorded_cast_to(copy))
    }

    /// One AdamW step of every slot (see the module docs): each slot's four tensors must share
    /// one layout (or all be local on one device); the results have it. Runs on this rank's
    /// pieces only, with one op for them all, so it communicates nothing.
    pub fn adamw_multi(slots: &[AdamWSlot<'_>], hyper: &AdamWHyper) -> Result<Vec<AdamWUpdated>> {
        Tensor::adamw_multi_by(slots, hyper, AdamWClip::Host)
    }

    /// [`Tensor::adamw_multi`] with every gradient also scaled by `min(r, 1)` (NaN for a NaN
    /// `r`), `r` the value of `ratio`, a 0-d f64 tensor (a global-norm clip ratio computed on
    /// the device), read by the kernels and never on the host: the same bits as
    /// `hyper.grad_scale` set to that scale ([`AdamWMulti::ratio_scale`]). Every rank holding
    /// a slot's piece must hold a piece of `ratio` on that device (a broadcast over a
    /// placement covering the slots', or a local tensor there).
    pub fn adamw_multi_clipped(
        slots: &[AdamWSlot<'_>],
        hyper: &AdamWHyper,
        ratio: &Tensor,
    ) -> Result<Vec<AdamWUpdated>> {
        Tensor::adamw_multi_by(slots, hyper, AdamWClip::Ratio(ratio))
    }

    /// [`Tensor::adamw_multi_clipped`], except that a NaN `ratio` leaves every slot as it was
    /// (the results hold the old values) instead of giving NaN values: a ratio made NaN on the
    /// device when a step's loss or gradient norm is not finite skips the step there, with
    /// nothing read on the host ([`AdamWMulti::skip_nan`]).
    pub fn adamw_multi_guarded(
        slots: &[AdamWSlot<'_>],
        hyper: &AdamWHyper,
        ratio: &Tensor,
    ) -> Result<Vec<AdamWUpdated>> {
        Tensor::adamw_multi_by(slots, hyper, AdamWClip::Guarded(ratio))
    }

    /// The multi-tensor AdamW with its gradients scaled as `clip` says: the one entry the
    /// three above name.
    pub fn adamw_multi_by(
        slots: &[AdamWSlot<'_>],
        hyper: &AdamWHyper,
        clip: AdamWClip<'_>,
    ) -> Result<Vec<AdamWUpdated>> {
        adamw_multi_with(slots, hyper, clip)
    }
}

/// A clip ratio operand, which must be a 0-d f64.
fn check_ratio(ratio: &Tensor) -> Result<&Tensor> {
    if ratio.ndim() != 0 || ratio.dtype() != DType::F64 {
        return Err(slot_err(
            0,
            format!("the clip ratio must be 0-d f64, got {}", ratio.describe()),
        ));
    }
    Ok(ratio)
}

/// How a multi-tensor AdamW scales its gradients: by `hyper.grad_scale` alone
/// ([`Tensor::adamw_multi`]), also by a device clip ratio ([`Tensor::adamw_multi_clipped`]),
/// or by one whose NaN leaves every tensor as it was ([`Tensor::adamw_multi_guarded`]).
#[derive(Clone, Copy, Debug)]
pub enum AdamWClip<'a> {
    Host,
    Ratio(&'a Tensor),
    Guarded(&'a Tensor),
}

/// [`Tensor::adamw_multi`], clipped as `clip` says.
fn adamw_multi_with(
    slots: &[AdamWSlot<'_>],
    hyper: &AdamWHyper,
    clip: AdamWClip<'_>,
) -> Result<Vec<AdamWUpdated>> {
    let (ratio, skip_nan) = match clip {
        AdamWClip::Host => (None, false),
        AdamWClip::Ratio(r) => (Some(check_ratio(r)?), false),
        AdamWClip::Guarded(r) => (Some(check_ratio(r)?), true),
    };
    let _ng = crate::grad_mode::no_grad();
    // Moments before the first step: zeros in the parameter's layout.
    let zeros = |t: Option<&Tensor>, p: &Tensor| match t {
        Some(t) => Ok(t.clone()),
        None => p.mul_scalar(0.0),
    };
    let mut full: Vec<[Tensor; 4]> = Vec::with_capacity(slots.len());
    for (i, s) in slots.iter().enumerate() {
        let four = [
            s.param.clone(),
            s.grad.clone(),
            zeros(s.m, s.param)?,
            zeros(s.v, s.param)?,
        ];
        for (name, t) in ["grad", "m", "v"].iter().zip(&four[1..]) {
            if t.shape() != s.param.shape()
                || t.dtype() != s.param.dtype()
                || t.layout() != s.param.layout()
            {
                return Err(slot_err(
                    i,
                    format!(
                        "{name} is {} but the parameter is {}",
                        t.describe(),
                        s.param.describe()
                    ),
                ));
            }
        }
        full.push(four);
    }
    // This rank's pieces: per device, one op for the slots written into new memory and one
    // for those written over their own.
    let mut out: Vec<Option<[Tensor; 3]>> = vec![None; slots.len()];
    let mut copies: Vec<Option<Tensor>> = vec![None; slots.len()];
    let mut devices = Vec::new();
    for d in full
        .iter()
        .filter_map(|f| f[0].storage().map(|s| s.device()))
    {
        if !devices.contains(&d) {
            devices.push(d);
        }
    }
    let capturing = crate::capture::capturing();
    for device in devices {
        let (reusing, fresh): (Vec<usize>, Vec<usize>) = (0..slots.len())
            .filter(|&i| full[i][0].storage().map(|s| s.device()) == Some(device))
            .partition(|&i| !capturing && device != crate::Device::Cpu && reuses(&slots[i]));
        for (group, reuse) in [(fresh, false), (reusing, true)] {
            if !group.is_empty() {
                let g = Group {
                    slots,
                    full: &full,
                    held: &group,
                    device,
                };
                g.run(hyper, ratio, skip_nan, reuse, &mut out, &mut copies)?;
            }
        }
    }
    full.iter()
        .zip(out)
        .zip(copies)
        .zip(slots)
        .map(|(((f, o), c), s)| {
            let wrap = |like: &Tensor, local: Option<&Tensor>| match local {
                Some(l) => with_piece_of(like, l),
                None => Tensor::with_layout_of(like, None),
            };
            let o = o.as_ref();
            let param = wrap(&f[0], o.map(|o| &o[0]))?;
            let copy = match s.compute_copy {
                Some(d) => Some(copy_of(&param, c.as_ref(), d)?),
                None => None,
            };
            Ok(AdamWUpdated {
                param,
                m: wrap(&f[2], o.map(|o| &o[1]))?,
                v: wrap(&f[3], o.map(|o| &o[2]))?,
                copy,
            })
        })
        .collect()
}

/// Whether slot `s` gives its memory to the update and can: its moments exist, and its old
/// compute copy is there when it wants one, of that dtype and the param's shape and layout.
fn reuses(s: &AdamWSlot<'_>) -> bool {
    let Some(r) = s.reuse else {
        return false;
    };
    let copy_fits = match (s.compute_copy, r.copy) {
        (None, _) => true,
        (Some(d), Some(c)) => {
            c.dtype() == d && c.shape() == s.param.shape() && c.layout() == s.param.layout()
        }
        (Some(_), None) => false,
    };
    s.m.is_some() && s.v.is_some() && copy_fits
}

/// The slots `held` whose pieces live on `device`, updated by one op.
struct Group<'s, 'a> {
    slots: &'s [AdamWSlot<'a>],
    /// (p, g, m, v) of every slot.
    full: &'s [[Tensor; 4]],
    held: &'s [usize],
    device: crate::Device,
}

impl Group<'_, '_> {
    /// Runs the group's op (over the slots' own memory with `reuse`, see [`AdamWReuse`]) and
    /// puts each slot's new local (p, m, v) in `out` and its copy in `copies`.
    fn run(
        &self,
        hyper: &AdamWHyper,
        ratio: Option<&Tensor>,
        skip_nan: bool,
        reuse: bool,
        out: &mut [Option<[Tensor; 3]>],
        copies: &mut [Option<Tensor>],
    ) -> Result<()> {
        let (slots, full, held) = (self.slots, self.full, self.held);
        let mut locals: Vec<Tensor> = held
            .iter()
            .flat_map(|&i| full[i].iter().map(Tensor::to_local))
            .collect();
        if let Some(c) = ratio {
            let here = c.to_local();
            if here.storage().map(|s| s.device()) != Some(self.device) {
                return Err(slot_err(
                    held[0],
                    format!(
                        "the clip ratio {} has no piece on {} here",
                        c.describe(),
                        self.device
                    ),
                ));
            }
            locals.push(here);
        }
        let decay: Vec<f64> = held.iter().map(|&i| slots[i].weight_decay).collect();
        let wanted: Vec<Option<DType>> = held.iter().map(|&i| slots[i].compute_copy).collect();
        let op = match ratio {
            Some(_) => AdamWMulti {
                clipped: true,
                skip_nan,
                ..AdamWMulti::new(
                    &AdamWHyper {
                        grad_scale: 1.0,
                        ..*hyper
                    },
                    &decay,
                    &wanted,
                )
            },
            None => AdamWMulti::new(hyper, &decay, &wanted),
        };
        let at: Vec<Option<usize>> = (0..held.len()).map(|k| op.copy_index(k)).collect();
        let refs: Vec<&Tensor> = locals.iter().collect();
        let res = if reuse {
            // (p, m, v) of each slot, then the old copies: the op's outputs, in its order.
            let mut targets: Vec<Tensor> = (0..held.len())
                .flat_map(|k| [0, 2, 3].map(|j| locals[4 * k + j].clone()))
                .collect();
            targets.extend(
                held.iter()
                    .filter_map(|&i| slots[i].compute_copy.and(slots[i].reuse?.copy))
                    .map(Tensor::to_local),
            );
            let into: Vec<&Tensor> = targets.iter().collect();
            crate::in_place::run_local_into(&op.clone().into(), &refs, &into)?;
            targets
        } else {
            dispatch_multi(op.into(), &refs)?
        };
        for (k, &i) in held.iter().enumerate() {
            let mut three = res[3 * k..3 * k + 3].iter();
            let mut next = || {
                three
                    .next()
                    .ok_or_else(|| slot_err(i, "the op gave too few outputs".into()))
            };
            out[i] = Some([next()?.clone(), next()?.clone(), next()?.clone()]);
            if let Some(c) = at[k] {
                let copy = res
                    .get(c)
                    .ok_or_else(|| slot_err(i, "the op gave no compute copy".into()))?;
                copies[i] = Some(copy.clone());
            }
        }
        Ok(())
    }
}
