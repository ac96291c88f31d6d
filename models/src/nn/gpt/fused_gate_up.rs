//! `FusedGateUp`: a SwiGLU MLP's gate and up projections as one product for decoding. The
//! weight `[C, F, 2]` holds each hidden unit's gate column beside its up column, so the
//! product's output `[.., F, 2]` feeds `oxiflow_ops::swiglu::swiglu_pairs` as it is, and a
//! split of F over the tensor-parallel axis (the columns in contiguous blocks, as the separate
//! projections' column splits) keeps each rank's pairs. One product and one activation where
//! a decoding step ran two products and the activation. The tensor is a copy of the
//! projections' compute values, made once and written again in place by
//! [`FusedGateUp::refresh`].

use oxiflow_ops::swiglu::swiglu_pairs;
use oxiflow_tensor::{MatmulPrecision, Tensor};

use super::super::linear::Linear;
use super::fused_qkv::refill;
use crate::{Result, TensorError};

/// One MLP's fused gate/up projection (see the module docs).
#[derive(Clone, Debug)]
pub struct FusedGateUp {
    /// `[C, F, 2]`.
    pub weight: Tensor,
}

impl FusedGateUp {
    /// The fused projection of `gate` and `up` (whose caller checked that they fuse: no
    /// biases, no adapters, split alike).
    pub(super) fn new(gate: &Linear, up: &Linear) -> Result<FusedGateUp> {
        let [g, u] = pieces(gate, up)?;
        Ok(FusedGateUp {
            weight: Tensor::concat(&[&g, &u], 2)?,
        })
    }

    /// Writes the current compute values of `gate` and `up` into the weight, in its own
    /// memory where nothing else holds it (else into a new tensor put in its place).
    pub(super) fn refresh(&mut self, gate: &Linear, up: &Linear) -> Result<()> {
        refill(&mut self.weight, &pieces(gate, up)?, 2, &[0, 1])
    }

    /// `silu(gate(h)) * up(h)` for h `[.., C]`: the product at `precision`, then the packed
    /// SwiGLU.
    pub(super) fn hidden(&self, h: &Tensor, precision: MatmulPrecision) -> Result<Tensor> {
        let dims = self.weight.shape().dims().to_vec();
        let &[c, f, 2] = dims.as_slice() else {
            return Err(TensorError::Shape {
                op: "FusedGateUp::hidden",
                shapes: self.weight.shape().to_string(),
                sbps: String::new(),
                detail: "the fused weight must be [C, F, 2]".into(),
            });
        };
        let y = h.matmul_at(&self.weight.reshape([c, 2 * f])?, precision)?;
        let mut packed = h.shape().dims().to_vec();
        packed.pop();
        packed.extend([f, 2]);
        swiglu_pairs(&y.reshape(packed)?)
    }
}

/// The compute values of `gate` and `up`, each `[C, F, 1]`.
fn pieces(gate: &Linear, up: &Linear) -> Result<[Tensor; 2]> {
    let (c, f) = (gate.in_features, gate.out_features);
    Ok([
        gate.weight.compute()?.reshape([c, f, 1])?,
        up.weight.compute()?.reshape([c, f, 1])?,
    ])
}
