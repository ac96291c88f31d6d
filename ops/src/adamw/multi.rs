//! The multi-tensor AdamW op: one op updates every tensor of an optimizer step, its math the
//! three passes' ([`AdamPart`]) element for element: `m = beta1 m + g1 g`, `v = beta2 v + g2
//! g^2`, `p = decay p - (step m) / (sqrt(inv_bc2 v) + eps)` with the clip factor folded into
//! `g1` and `g2`; on CUDA one launch for every f32 tensor, the three passes per tensor
//! elsewhere. A tensor whose layers compute in another dtype (mixed precision) can ask for the
//! new value's copy in it ([`AdamWSlot::compute_copy`]): the same launch writes it on CUDA
//! (bf16 from f32), a cast after the passes elsewhere, the same bits either way. A global-norm
//! clip may also come as a 0-d f64 operand, the ratio `max_norm / (norm + eps)` computed on the
//! device, so an update is queued with nothing read on the host; it gives the same bits as the
//! factor `min(ratio, 1)` folded on the host.

use oxiflow_dtype::DType;
use oxiflow_sbp::{rules, RuleMode, Shape};
use oxiflow_tensor::backend::{kernel_err, ElementwiseKernels};
use oxiflow_tensor::{F64Bits, Inferred, KernelBackend, MetaError, MetaResult, Result, Tensor};

use super::part::AdamPart;

/// A typed error unless `dt` is a float dtype (`what` names the operand).
fn need_float(dt: DType, what: &str) -> MetaResult<()> {
    if dt.is_float() {
        Ok(())
    } else {
        Err(MetaError::DType(format!(
            "{what} must be a float dtype, got {dt}"
        )))
    }
}

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
/// capture, the new param, m and v are written over the slot's own (moments not made yet, before
/// the first step, over the zeros made for them) and the new compute copy over `copy` (the old
/// one, of the copy's dtype and the param's shape and layout; None: into new memory);
/// otherwise the update writes new memory, as without it. The results are
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
    pub(super) fn operands(&self) -> usize {
        4 * self.decay.len() + usize::from(self.clipped)
    }

    /// The output index of tensor `i`'s copy, when it has one.
    pub fn copy_index(&self, i: usize) -> Option<usize> {
        self.copies.get(i).copied().flatten()?;
        let before = self.copies[..i].iter().filter(|c| c.is_some()).count();
        Some(3 * self.decay.len() + before)
    }

    /// Number of outputs: (p, m, v) per tensor and the copies.
    pub(super) fn outputs(&self) -> usize {
        3 * self.decay.len() + self.copies.iter().filter(|c| c.is_some()).count()
    }

    /// A kernel error unless a kernel got this op's number of operands and outputs.
    pub(super) fn check_io(&self, inputs: usize, outputs: usize) -> Result<()> {
        if inputs == self.operands() && outputs == self.outputs() {
            return Ok(());
        }
        Err(kernel_err(
            "adamw_multi",
            format!(
                "{} tensors need {} operands and {} outputs, got {inputs} and {outputs}",
                self.decay.len(),
                self.operands(),
                self.outputs(),
            ),
        ))
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
    pub(super) fn composed<B: AdamPasses>(
        &self,
        b: &B,
        range: std::ops::Range<usize>,
        x: &[&B::Piece],
        out: &mut [B::Out],
        keep: bool,
    ) -> Result<()> {
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
                b.pass(m1, &[m, g], mo)?;
                b.pass(m2, &[v, g], vo)?;
                b.pass(up, &[p, mo, vo], po)?;
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
    pub(super) fn cast_copy<B: AdamPasses>(
        &self,
        b: &B,
        i: usize,
        out: &mut [B::Out],
    ) -> Result<()> {
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

/// The backend kernels the composed passes use: one [`AdamPart`] pass into an output buffer
/// and a cast (every backend's element-wise kernel).
pub(super) trait AdamPasses:
    KernelBackend<Out = <Self as KernelBackend>::Piece> + ElementwiseKernels
{
    fn pass(&self, part: AdamPart, x: &[&Self::Piece], out: &mut Self::Out) -> Result<()>;
}

impl AdamWMulti {
    /// The op's coefficients, copies and clip flags as bytes (its attributes).
    pub(super) fn key(&self, key: &mut Vec<u8>) {
        let scalars = [
            self.beta1,
            self.g1,
            self.beta2,
            self.g2,
            self.step,
            self.inv_bc2,
            self.eps,
        ];
        for c in scalars.iter().chain(&self.decay) {
            key.extend_from_slice(&c.get().to_bits().to_le_bytes());
        }
        key.extend_from_slice(&(self.decay.len() as u64).to_le_bytes());
        // A copy's dtype code, or one past every code for no copy.
        key.extend(self.copies.iter().map(|c| c.map_or(u8::MAX, DType::code)));
        key.extend([u8::from(self.clipped), u8::from(self.skip_nan)]);
    }

    /// Every output's dtype and the rules: per tensor four operands of one shape and float
    /// dtype, then the clip ratio, a 0-d f64, when clipped.
    pub(super) fn meta(&self, s: &[&Shape], d: &[DType], mode: RuleMode) -> MetaResult<Inferred> {
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
        // path is `adamw_multi`, on local pieces).
        let r = rules::whole(outs, self.operands(), mode);
        Ok(Inferred::outputs(r, &dtypes))
    }
}

/// How a multi-tensor AdamW scales its gradients: by `hyper.grad_scale` alone
/// ([`adamw_multi`](super::adamw_multi)), also by a device clip ratio ([`adamw_multi_clipped`](super::adamw_multi_clipped)),
/// or by one whose NaN leaves every tensor as it was ([`adamw_multi_guarded`](super::adamw_multi_guarded)).
#[derive(Clone, Copy, Debug)]
pub enum AdamWClip<'a> {
    Host,
    Ratio(&'a Tensor),
    Guarded(&'a Tensor),
}
