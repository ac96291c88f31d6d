//! The multi-tensor AdamW step ([`adamw_multi`]): AdamW is element-wise, so a rank updates
//! its own pieces of (param, grad, m, v), which share a layout whatever it is (ZeRO shards,
//! tensor-parallel splits, pipeline stages): the step runs one [`AdamWMulti`] per device on the
//! rank's local pieces and hands the results back in their tensors' layouts, with no
//! communication.

use oxiflow_dtype::DType;
use oxiflow_tensor::{
    capture, dispatch_multi, no_grad, run_local_into, Device, Extern, Result, Tensor, TensorError,
};

use super::multi::{AdamWClip, AdamWHyper, AdamWMulti, AdamWSlot, AdamWUpdated};

/// A typed error naming slot `i` of the multi-tensor step.
fn slot_err(i: usize, detail: String) -> TensorError {
    TensorError::Shape {
        op: "adamw_multi",
        shapes: String::new(),
        sbps: String::new(),
        detail: format!("tensor {i}: {detail}"),
    }
}

/// One AdamW step of every slot (see the module docs): each slot's four tensors must share one
/// layout (or all be local on one device); the results have it. Runs on this rank's pieces
/// only, with one op for them all, so it communicates nothing.
pub fn adamw_multi(slots: &[AdamWSlot<'_>], hyper: &AdamWHyper) -> Result<Vec<AdamWUpdated>> {
    adamw_multi_by(slots, hyper, AdamWClip::Host)
}

/// [`adamw_multi`] with every gradient also scaled by `min(r, 1)` (NaN for a NaN `r`), `r`
/// the value of `ratio`, a 0-d f64 tensor (a global-norm clip ratio computed on the device),
/// read by the kernels and never on the host: the same bits as `hyper.grad_scale` set to that
/// scale ([`AdamWMulti::ratio_scale`]). Every rank holding a slot's piece must hold a piece of
/// `ratio` on that device (a broadcast over a placement covering the slots', or a local tensor
/// there).
pub fn adamw_multi_clipped(
    slots: &[AdamWSlot<'_>],
    hyper: &AdamWHyper,
    ratio: &Tensor,
) -> Result<Vec<AdamWUpdated>> {
    adamw_multi_by(slots, hyper, AdamWClip::Ratio(ratio))
}

/// [`adamw_multi_clipped`], except that a NaN `ratio` leaves every slot as it was (the results
/// hold the old values) instead of giving NaN values: a ratio made NaN on the device when a
/// step's loss or gradient norm is not finite skips the step there, with nothing read on the
/// host ([`AdamWMulti::skip_nan`]).
pub fn adamw_multi_guarded(
    slots: &[AdamWSlot<'_>],
    hyper: &AdamWHyper,
    ratio: &Tensor,
) -> Result<Vec<AdamWUpdated>> {
    adamw_multi_by(slots, hyper, AdamWClip::Guarded(ratio))
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

/// The multi-tensor AdamW with its gradients scaled as `clip` says: the one entry the three
/// above name.
pub fn adamw_multi_by(
    slots: &[AdamWSlot<'_>],
    hyper: &AdamWHyper,
    clip: AdamWClip<'_>,
) -> Result<Vec<AdamWUpdated>> {
    let (ratio, skip_nan) = match clip {
        AdamWClip::Host => (None, false),
        AdamWClip::Ratio(r) => (Some(check_ratio(r)?), false),
        AdamWClip::Guarded(r) => (Some(check_ratio(r)?), true),
    };
    let _ng = no_grad();
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
    let capturing = capture::capturing();
    for device in devices {
        let (reusing, fresh): (Vec<usize>, Vec<usize>) = (0..slots.len())
            .filter(|&i| full[i][0].storage().map(|s| s.device()) == Some(device))
            .partition(|&i| !capturing && device != Device::Cpu && reuses(&slots[i]));
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
            let wrap = |like: &Tensor, local: Option<&Tensor>| {
                Tensor::with_layout_over(like, local, like.dtype())
            };
            let o = o.as_ref();
            let param = wrap(&f[0], o.map(|o| &o[0]))?;
            let copy = match s.compute_copy {
                Some(d) => Some(Tensor::with_layout_over(&param, c.as_ref(), d)?),
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

/// Whether slot `s` gives its memory to the update and can: an old compute copy it gives is of
/// the copy's dtype and the param's shape and layout (without one, the new copy is written
/// into new memory). Moments not made yet (the first step) are the zeros made above, which
/// nothing else holds.
fn reuses(s: &AdamWSlot<'_>) -> bool {
    let Some(r) = s.reuse else {
        return false;
    };
    match (s.compute_copy, r.copy) {
        (Some(d), Some(c)) => {
            c.dtype() == d && c.shape() == s.param.shape() && c.layout() == s.param.layout()
        }
        _ => true,
    }
}

/// The slots `held` whose pieces live on `device`, updated by one op.
struct Group<'s, 'a> {
    slots: &'s [AdamWSlot<'a>],
    /// (p, g, m, v) of every slot.
    full: &'s [[Tensor; 4]],
    held: &'s [usize],
    device: Device,
}

impl Group<'_, '_> {
    /// Runs the group's op (over the slots' own memory with `reuse`, see [`AdamWReuse`](super::AdamWReuse)) and
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
            // (p, m, v) of each slot, then the copies (over the old ones, else new memory of
            // the copy's dtype, never the param's even where the dtypes agree): the op's
            // outputs, in its order.
            let mut targets: Vec<Tensor> = (0..held.len())
                .flat_map(|k| [0, 2, 3].map(|j| locals[4 * k + j].clone()))
                .collect();
            for (k, &i) in held.iter().enumerate() {
                let Some(d) = slots[i].compute_copy else {
                    continue;
                };
                targets.push(match slots[i].reuse.and_then(|r| r.copy) {
                    Some(old) => old.to_local(),
                    None => locals[4 * k].mul_scalar(0.0)?.to_dtype(d)?,
                });
            }
            let into: Vec<&Tensor> = targets.iter().collect();
            run_local_into(&Extern::new(op.clone()).into(), &refs, &into)?;
            targets
        } else {
            dispatch_multi(Extern::new(op.clone()).into(), &refs)?
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
