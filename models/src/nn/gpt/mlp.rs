//! `GptMlp`: the dense MLP of a decoder block (GELU or SwiGLU), Megatron tensor-parallel on
//! the tensor-parallel axis, and the fused residual MLP where its weights are whole.

use oxiflow_ops::residual_mlp::residual_mlp_with;
use oxiflow_sbp::Sbp;

use crate::Result;
use oxiflow_tensor::Tensor;

use super::super::linear::Linear;
use super::super::param::{Module, Parameter};
use super::arch::{Arch, MlpKind};
use super::config::{GptConfig, GptLayout};
use super::fused_gate_up::FusedGateUp;

/// The MLP of a block. GELU: `name.fc` `[C, F]` (column-parallel) -> GELU -> `name.proj`
/// `[F, C]` (row-parallel). SwiGLU: `name.gate` and `name.up` `[C, F]` (column-parallel) ->
/// `silu(gate) * up` -> `name.down` `[F, C]` (row-parallel); `fc` is `up`, `proj` is `down`.
#[derive(Clone, Debug)]
pub struct GptMlp {
    pub fc: Linear,
    pub gate: Option<Linear>,
    pub proj: Linear,
}

impl GptMlp {
    pub fn new(name: &str, cfg: &GptConfig, arch: &Arch, layout: &GptLayout) -> Result<GptMlp> {
        let (c, f) = (cfg.width, arch.ffn(cfg));
        let opts = |parallel| layout.linear_biased(cfg, parallel, arch.mlp_bias);
        let (column, row) = (opts(layout.column()), opts(layout.row()));
        let (fc, proj, gate) = match arch.mlp {
            MlpKind::Gelu => ("fc", "proj", None),
            MlpKind::SwiGlu => ("up", "down", Some("gate")),
        };
        Ok(GptMlp {
            gate: gate
                .map(|g| Linear::new(&format!("{name}.{g}"), c, f, &column))
                .transpose()?,
            fc: Linear::new(&format!("{name}.{fc}"), c, f, &column)?,
            proj: Linear::new(&format!("{name}.{proj}"), f, c, &row)?,
        })
    }

    /// Its gate and up projections as one for decoding, or None where they do not fuse (no
    /// gate, or biases or adapters on them).
    pub fn fused_gate_up(&self) -> Result<Option<FusedGateUp>> {
        match self.fusable_gate() {
            Some(gate) => FusedGateUp::new(gate, &self.fc).map(Some),
            None => Ok(None),
        }
    }

    /// Writes the projections' current values into `fused` (made by
    /// [`GptMlp::fused_gate_up`]), in place where it may.
    pub fn refresh_fused_gate_up(&self, fused: &mut FusedGateUp) -> Result<()> {
        match self.fusable_gate() {
            Some(gate) => fused.refresh(gate, &self.fc),
            None => Err(crate::TensorError::Shape {
                op: "GptMlp::refresh_fused_gate_up",
                shapes: fused.weight.shape().to_string(),
                sbps: String::new(),
                detail: "the MLP's gate and up no longer fuse".into(),
            }),
        }
    }

    /// The gate where gate and up fuse: both without bias or adapter.
    fn fusable_gate(&self) -> Option<&Linear> {
        let plain = |l: &Linear| l.bias.is_none() && l.lora.is_none();
        self.gate.as_ref().filter(|g| plain(g) && plain(&self.fc))
    }

    /// The hidden activation of h with the gate and up as one product where `fused` is given
    /// (made by [`GptMlp::fused_gate_up`]), else as [`GptMlp::hidden`].
    pub fn hidden_with(&self, h: &Tensor, fused: Option<&FusedGateUp>) -> Result<Tensor> {
        match (fused, self.fusable_gate()) {
            (Some(f), Some(_)) => f.hidden(h, self.fc.weight.matmul_precision()),
            _ => self.hidden(h),
        }
    }

    /// The hidden activation of h (whole on the tensor-parallel axis): `gelu(fc(h))`, or
    /// `silu(gate(h)) * up(h)` (one fused op, `oxiflow_ops::swiglu`).
    pub fn hidden(&self, h: &Tensor) -> Result<Tensor> {
        match &self.gate {
            None => self.fc.forward_gelu(h),
            Some(gate) => oxiflow_ops::swiglu::swiglu(&gate.forward(h)?, &self.fc.forward(h)?),
        }
    }

    /// `residual + proj(gelu(fc(h)))` as one fused op ([`residual_mlp_with`]) where both
    /// layers compute with weights and biases whole on every rank (no tensor parallelism;
    /// ZeRO-3 shards are gathered) and carry no adapter; None otherwise (the layers compose). `recompute_hidden`:
    /// GELU's output is computed again in the backward instead of kept.
    pub fn fused_residual(
        &self,
        h: &Tensor,
        residual: &Tensor,
        recompute_hidden: bool,
    ) -> Result<Option<Tensor>> {
        let (Some(b_fc), Some(b_proj), None) = (&self.fc.bias, &self.proj.bias, &self.gate) else {
            return Ok(None);
        };
        if self.proj.is_partial() || self.fc.lora.is_some() || self.proj.lora.is_some() {
            return Ok(None);
        }
        // The values the layers compute with (a ZeRO-3 shard gathered whole).
        let w = [&self.fc.weight, b_fc, &self.proj.weight, b_proj]
            .map(Parameter::compute)
            .into_iter()
            .collect::<Result<Vec<_>>>()?;
        if w.iter().any(|t| t.has_sbp_over_ranks(|s| s != Sbp::B)) {
            return Ok(None);
        }
        Ok(Some(residual_mlp_with(
            h,
            &w[0],
            &w[1],
            &w[2],
            &w[3],
            residual,
            (recompute_hidden, self.fc.weight.matmul_precision()),
        )?))
    }
}

impl Module for GptMlp {
    fn parameters(&self) -> Vec<Parameter> {
        let mut v: Vec<Parameter> = self.gate.iter().flat_map(|g| g.parameters()).collect();
        v.extend(self.fc.parameters());
        v.extend(self.proj.parameters());
        v
    }
}
