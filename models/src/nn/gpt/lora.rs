//! LoRA fine-tuning of the decoder family: `LoraSpec` names the linear layers that get an
//! adapter by the short names of the architecture's Hugging Face modules (Llama, Qwen2,
//! Mistral: `q k v o gate up down`, or PEFT's `q_proj` ... `down_proj`; GPT-2: `c_fc`, and
//! `c_proj` for both of a block's output projections, as PEFT matches it), checked against
//! the sizes before any tensor exists; `Gpt::attach_lora` freezes every base parameter and
//! adds the adapters; `Gpt::merged_parameters` gives the base parameters with every adapter
//! merged into its weight (what a merged export writes).

use crate::{Result, TensorError};

use super::super::linear::Linear;
use super::super::lora::{Lora, LoraOptions};
use super::super::param::{Module, Parameter};
use super::arch::{Arch, MlpKind};
use super::block::BlockMlp;
use super::config::GptConfig;
use super::model::Gpt;

/// The targets of a Llama-style decoder: (short name, PEFT's name, the layer in a block).
const LLAMA_TARGETS: &[(&str, &str, &str)] = &[
    ("q", "q_proj", "attn.q"),
    ("k", "k_proj", "attn.k"),
    ("v", "v_proj", "attn.v"),
    ("o", "o_proj", "attn.proj"),
    ("gate", "gate_proj", "mlp.gate"),
    ("up", "up_proj", "mlp.up"),
    ("down", "down_proj", "mlp.down"),
];

/// The targets of GPT-2 (Conv1D modules; `c_proj` names both output projections).
const GPT2_TARGETS: &[(&str, &str, &str)] = &[
    ("c_fc", "c_fc", "mlp.fc"),
    ("c_proj", "c_proj", "attn.proj"),
    ("c_proj", "c_proj", "mlp.proj"),
];

/// Which layers of a decoder get adapters, and their size.
#[derive(Clone, Debug, PartialEq)]
pub struct LoraSpec {
    pub options: LoraOptions,
    /// Target names as given (see the module docs).
    pub targets: Vec<String>,
}

fn spec_err(detail: String) -> TensorError {
    TensorError::Shape {
        op: "LoraSpec::check",
        shapes: "-".into(),
        sbps: "-".into(),
        detail,
    }
}

fn table(arch: &Arch) -> &'static [(&'static str, &'static str, &'static str)] {
    match arch.mlp {
        MlpKind::SwiGlu => LLAMA_TARGETS,
        MlpKind::Gelu => GPT2_TARGETS,
    }
}

impl LoraSpec {
    /// The layers in a block (`attn.q`, `mlp.proj`, ...) the targets name, in block order, each
    /// with its Hugging Face module name; an unknown target is an error naming it and the
    /// targets this architecture has.
    fn layers(&self, arch: &Arch) -> Result<Vec<(&'static str, &'static str)>> {
        let known = table(arch);
        if self.targets.is_empty() {
            return Err(spec_err("no LoRA targets given".into()));
        }
        let mut picked = Vec::new();
        for t in &self.targets {
            let hits: Vec<_> = known
                .iter()
                .filter(|(short, hf, _)| t == short || t == hf)
                .collect();
            if hits.is_empty() {
                let mut names: Vec<&str> = known.iter().map(|k| k.0).collect();
                names.dedup();
                let fused = if t == "c_attn" {
                    " (GPT-2's fused c_attn adapter, one A shared by Q, K and V, is not \
                     supported)"
                } else {
                    ""
                };
                return Err(spec_err(format!(
                    "LoRA target {t:?} is not a layer of this model{fused}; its targets are {}",
                    names.join(",")
                )));
            }
            for &&(_, hf, layer) in &hits {
                if picked.iter().any(|&(l, _)| l == layer) {
                    return Err(spec_err(format!("LoRA target {t:?} is named twice")));
                }
                picked.push((layer, hf));
            }
        }
        picked.sort_by_key(|&(layer, _)| known.iter().position(|k| k.2 == layer));
        Ok(picked)
    }

    /// Checks the targets against `arch` and each targeted layer's size against the rank,
    /// from the sizes alone (no tensor built).
    pub fn check(&self, cfg: &GptConfig, arch: &Arch) -> Result<()> {
        let layers = self.layers(arch)?;
        if let (Some(_), Some((layer, _))) = (
            &arch.moe,
            layers.iter().find(|(l, _)| l.starts_with("mlp.")),
        ) {
            return Err(spec_err(format!(
                "--lora-targets names {layer}, an MLP layer, but this model's MLPs are mixtures \
                 of experts: adapters on experts are not supported (target the attention's \
                 q,k,v,o)"
            )));
        }
        let shapes = Gpt::parameter_shapes(cfg, arch);
        for (layer, _) in layers {
            let name = format!("h.0.{layer}.weight");
            if let Some((_, s)) = shapes.iter().find(|(n, _)| *n == name) {
                if let [i, o] = s[..] {
                    self.options.check(&format!("h.*.{layer}"), i, o)?;
                }
            }
        }
        Ok(())
    }

    /// The adapters' parameters in a decoder of `cfg` and `arch`: r (in + out) for every
    /// targeted layer of every block (0 when a target is unknown, which `check` refuses).
    pub fn parameter_count(&self, cfg: &GptConfig, arch: &Arch) -> usize {
        let Ok(layers) = self.layers(arch) else {
            return 0;
        };
        let shapes = Gpt::parameter_shapes(cfg, arch);
        let per_block: usize = layers
            .iter()
            .filter_map(|(layer, _)| {
                let name = format!("h.0.{layer}.weight");
                shapes.iter().find(|(n, _)| *n == name)
            })
            .map(|(_, s)| self.options.rank * s.iter().sum::<usize>())
            .sum();
        per_block * cfg.layers
    }

    /// The Hugging Face module names of the targets (PEFT's `target_modules`).
    pub fn hf_modules(&self, arch: &Arch) -> Result<Vec<String>> {
        let mut v: Vec<String> = self
            .layers(arch)?
            .into_iter()
            .map(|(_, hf)| hf.to_string())
            .collect();
        v.dedup();
        Ok(v)
    }
}

/// The place in its block (`attn.q`, `mlp.up`, ...) of the layer whose weight is `name`
/// (`h.<i>.<place>.weight`).
fn place_in_block(name: &str) -> Option<&str> {
    let rest = name.strip_prefix("h.")?.split_once('.')?.1;
    rest.strip_suffix(".weight")
}

impl Gpt {
    /// Every linear layer of the blocks.
    fn linears_mut(&mut self) -> Vec<&mut Linear> {
        let mut v = Vec::new();
        for b in &mut self.blocks {
            let attn = &mut b.attn;
            v.extend([&mut attn.q, &mut attn.k, &mut attn.v, &mut attn.proj]);
            if let BlockMlp::Dense(mlp) = &mut b.mlp {
                v.extend(mlp.gate.as_mut());
                v.extend([&mut mlp.fc, &mut mlp.proj]);
            }
        }
        v
    }

    /// The linear layers of the blocks that carry an adapter.
    pub fn adapted(&self) -> Vec<&Linear> {
        self.blocks
            .iter()
            .flat_map(|b| {
                let a = &b.attn;
                let dense = match &b.mlp {
                    BlockMlp::Dense(m) => m.gate.iter().chain([&m.fc, &m.proj]).collect(),
                    BlockMlp::Moe(_) => Vec::new(),
                };
                [&a.q, &a.k, &a.v, &a.proj].into_iter().chain(dense)
            })
            .filter(|l| l.lora.is_some())
            .collect()
    }

    /// Freezes every parameter of the model and attaches a fresh adapter to each layer `spec`
    /// targets (checked first: nothing changes when it fails; a model takes one set). Adapters
    /// are seeded by the model's seed and their names, like every parameter.
    pub fn attach_lora(&mut self, spec: &LoraSpec) -> Result<()> {
        spec.check(&self.cfg, &self.arch)?;
        if !self.adapted().is_empty() {
            return Err(spec_err("the model has LoRA adapters already".into()));
        }
        let layers = spec.layers(&self.arch)?;
        for p in self.parameters() {
            p.freeze();
        }
        let seed = self.cfg.seed;
        for lin in self.linears_mut() {
            let place = place_in_block(lin.weight.name());
            if layers.iter().any(|&(l, _)| Some(l) == place) {
                lin.attach_lora(spec.options, seed)?;
            }
        }
        Ok(())
    }

    /// The base parameters (no adapters), each adapted layer's weight replaced by a parameter
    /// of the same name holding `W + (alpha / r) A B` in its layout: the model an export with
    /// the adapters merged writes. Without adapters, the parameters themselves.
    pub fn merged_parameters(&self) -> Result<Vec<Parameter>> {
        let adapted = self.adapted();
        let adapter_names: Vec<String> = adapted
            .iter()
            .flat_map(|l| l.lora.iter().flat_map(Lora::parameters))
            .map(|p| p.name().to_string())
            .collect();
        let mut out = Vec::new();
        for p in self.parameters() {
            if adapter_names.iter().any(|n| n == p.name()) {
                continue;
            }
            match adapted.iter().find(|l| l.weight.name() == p.name()) {
                Some(l) => out.push(Parameter::new(p.name(), &l.merged_weight()?)),
                None => out.push(p),
            }
        }
        Ok(out)
    }
}
