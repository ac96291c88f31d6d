//! The decoder a job runs: `DecoderSpec`, its sizes and architecture from the flags (`--model
//! gpt`, `--model llama` with its flags) or from a Hugging Face directory (`--from-hf`, whose
//! weights it also reads), resolved before the world starts; and `build_decoder`, the model on
//! the job's stages (pipeline split or not), its weights read from the directory when there is
//! one (each rank its own pieces, every check before any step), LoRA adapters attached when
//! asked for, its compute dtype and recomputation set.

use std::sync::Arc;

use oxiflow_dtype::MixedPrecision;
use oxiflow_models::hf::{Family, HfCheckpoint, HfConfig};
use oxiflow_models::nn::gpt::{Arch, Gpt, GptConfig, GptLayout, LoraSpec, MlpKind, StageSplit};
use oxiflow_models::nn::{LoraOptions, Module};
use oxiflow_ops::context_parallel::CpAlgorithm;
use oxiflow_placement::{DeviceType, MeshLayout, NamedMesh};

use crate::config::{CpAttentionArg, ModelKind, TrainConfig};
use crate::error::TrainError;

/// What decoder a job runs (see the module docs).
#[derive(Clone)]
pub struct DecoderSpec {
    /// Its sizes: the vocabulary, the longest sequence (rows of a learned position table),
    /// layers, heads, width, and the job's dtype, seed, dropout, padding and sequence
    /// parallelism.
    pub cfg: GptConfig,
    pub arch: Arch,
    /// The Hugging Face architecture it is (and is written back as).
    pub family: Family,
    /// The token ids that end a generated sequence.
    pub eos: Vec<usize>,
    /// The directory its weights come from (`--from-hf`), opened and its headers read.
    pub hf: Option<Arc<HfCheckpoint>>,
    /// LoRA adapters on its linear layers, the base frozen (`--lora-rank`).
    pub lora: Option<LoraSpec>,
}

impl DecoderSpec {
    /// The Hugging Face directory `--from-hf` names, opened (its configuration checked, its
    /// weights' headers read); None without the flag.
    pub fn open_hf(cfg: &TrainConfig) -> Result<Option<Arc<HfCheckpoint>>, TrainError> {
        let Some(dir) = &cfg.model.from_hf else {
            return Ok(None);
        };
        let ck = HfCheckpoint::open(dir)?;
        if !cfg.generates_only() {
            ck.config.check_window(cfg.model.seq_len)?;
        }
        Ok(Some(Arc::new(ck)))
    }

    /// The decoder of `cfg` over a vocabulary of `vocab` ids (the data's; a Hugging Face
    /// model's own when `hf` is given), ending generated text at `eos`.
    pub fn resolve(
        cfg: &TrainConfig,
        vocab: usize,
        eos: Option<usize>,
        hf: Option<Arc<HfCheckpoint>>,
    ) -> DecoderSpec {
        let m = &cfg.model;
        let base = GptConfig {
            vocab,
            vocab_multiple: m.vocab_multiple,
            seq_len: m.seq_len,
            layers: m.layers,
            heads: m.heads,
            width: m.width,
            dropout: m.dropout,
            seed: m.seed,
            dtype: m.dtype,
            sequence_parallel: cfg.parallel.sp,
            context_attention: match cfg.parallel.cp_attention {
                CpAttentionArg::Ring => CpAlgorithm::Ring,
                CpAttentionArg::Alltoall => CpAlgorithm::AllToAll,
            },
        };
        if let Some(ck) = hf {
            let c = &ck.config;
            return DecoderSpec {
                cfg: c.gpt_config(&base),
                lora: lora_spec(cfg, &c.arch),
                arch: c.arch.clone(),
                family: c.family,
                eos: c.eos.clone(),
                hf: Some(ck),
            };
        }
        let (arch, family) = match m.model {
            ModelKind::Llama => {
                let arch = Arch {
                    tie_embeddings: m.tie_embeddings,
                    ..Arch::llama(
                        m.kv_heads.unwrap_or(m.heads),
                        m.ffn_width.unwrap_or(4 * m.width),
                        m.rope_theta,
                        m.norm_eps,
                    )
                };
                (arch, Family::Llama)
            }
            _ => (Arch::gpt2(), Family::Gpt2),
        };
        DecoderSpec {
            cfg: base,
            lora: lora_spec(cfg, &arch),
            arch,
            family,
            eos: eos.into_iter().collect(),
            hf: None,
        }
    }

    /// Checks the Hugging Face weights (when there are any) against the decoder's parameters:
    /// every name, shape and dtype, from the files' headers, before any tensor exists.
    pub fn check(&self) -> Result<(), TrainError> {
        if let Some(ck) = &self.hf {
            ck.plan(&Gpt::parameter_shapes(&self.cfg, &self.arch))?;
        }
        if let Some(l) = &self.lora {
            l.check(&self.cfg, &self.arch)
                .map_err(|e| TrainError::Config {
                    detail: format!(
                        "--lora-rank {} --lora-targets {}: {}",
                        l.options.rank,
                        l.targets.join(","),
                        lora_detail(e)
                    ),
                })?;
        }
        Ok(())
    }

    /// The Hugging Face configuration this decoder is written back with.
    pub fn hf_config(&self) -> HfConfig {
        match &self.hf {
            Some(ck) => ck.config.clone(),
            None => HfConfig::of_model(self.family, &self.cfg, &self.arch, self.eos.clone()),
        }
    }

    /// A one-line description for the log.
    pub fn describe(&self) -> String {
        let (c, a) = (&self.cfg, &self.arch);
        let from = self
            .hf
            .as_ref()
            .map_or(String::new(), |h| format!(" from {}", h.dir.display()));
        format!(
            "{}{from} layers {} heads {} kv-heads {} width {} ffn {} vocab {} (table {} rows) {:?} {:?} {} dropout {} dtype {}",
            self.family.architecture(),
            c.layers,
            c.heads,
            a.kv(c),
            c.width,
            a.ffn(c),
            c.vocab,
            c.table_rows(),
            a.norm,
            a.positions,
            if a.tie_embeddings { "tied" } else { "untied" },
            c.dropout,
            c.dtype
        )
    }
}

/// The LoRA adapters `cfg` asks for on a decoder of `arch` (the targets by default: q,v for a
/// Llama-style MLP, PEFT's default; c_fc,c_proj for GPT-2).
fn lora_spec(cfg: &TrainConfig, arch: &Arch) -> Option<LoraSpec> {
    let m = &cfg.model;
    let rank = m.lora_rank?;
    let targets = match (&m.lora_targets, arch.mlp) {
        (Some(t), _) => t.split(',').map(|s| s.trim().to_string()).collect(),
        (None, MlpKind::SwiGlu) => vec!["q".into(), "v".into()],
        (None, MlpKind::Gelu) => vec!["c_fc".into(), "c_proj".into()],
    };
    Some(LoraSpec {
        options: LoraOptions {
            rank,
            alpha: m.lora_alpha,
        },
        targets,
    })
}

/// The detail of a LoRA check's error.
fn lora_detail(e: oxiflow_tensor::TensorError) -> String {
    match e {
        oxiflow_tensor::TensorError::Shape { detail, .. } => detail,
        other => other.to_string(),
    }
}

/// The decoder of `spec` on `stages` (one named mesh per pipeline stage) with
/// `virtual_stages` chunks per stage, its weights read from the Hugging Face directory when
/// there is one, given the precision policy `precision`.
pub fn build_decoder(
    spec: &DecoderSpec,
    stages: &[NamedMesh],
    virtual_stages: usize,
    precision: &MixedPrecision,
) -> Result<Gpt, TrainError> {
    let split = if stages.len() == 1 && virtual_stages == 1 {
        StageSplit::single(spec.cfg.layers, &GptLayout::Mesh(stages[0].clone()))
    } else {
        let layouts = stages.iter().cloned().map(GptLayout::Mesh).collect();
        StageSplit::new(spec.cfg.layers, layouts, virtual_stages)?
    };
    let mut model = Gpt::with_arch(&spec.cfg, &spec.arch, split)?;
    if let Some(ck) = &spec.hf {
        ck.load_into(&model.parameters())?;
    }
    if let Some(l) = &spec.lora {
        model.attach_lora(l)?;
    }
    model.set_precision(precision)?;
    if spec.lora.is_some() {
        // The frozen base is stored as it computes (bf16 under bf16-mixed), the adapters in
        // the model's dtype.
        for p in model.parameters() {
            p.store_frozen_in_compute_dtype()?;
        }
    }
    Ok(model)
}

/// The stages of `mesh` on `device` and the one holding this process's rank.
pub fn stages_of(
    mesh: &MeshLayout,
    device: DeviceType,
) -> Result<(Vec<NamedMesh>, usize), TrainError> {
    let rank = oxiflow_tensor::Context::current()
        .ok_or_else(|| TrainError::Layout {
            detail: "no runtime context".into(),
        })?
        .rank();
    let stages = mesh.stages(device)?;
    let stage = stages
        .iter()
        .position(|s| s.placement().contains(rank))
        .ok_or_else(|| TrainError::Layout {
            detail: format!("rank {rank} is in no stage of the mesh {mesh}"),
        })?;
    Ok((stages, stage))
}
