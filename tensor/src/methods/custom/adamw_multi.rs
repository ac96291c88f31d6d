//! The `Tensor` methods of the custom op `op/custom/adamw_multi.rs`: they build its
//! ops and dispatch them.

use oxiflow_dtype::DType;

use crate::dispatch::dispatch_multi;
use crate::op::custom::{AdamWClip, AdamWHyper, AdamWMulti, AdamWSlot, AdamWUpdated};
use crate::tensor::Tensor;
use crate::{Result, TensorError};

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
