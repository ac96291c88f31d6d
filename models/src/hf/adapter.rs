//! `save_adapter`: a decoder's LoRA adapters alone, in PEFT's layout: `adapter_model.safetensors`
//! with `base_model.model.<module>.lora_A.weight` `[r, in]` and `.lora_B.weight` `[out, r]`
//! for each adapted module under its family's Hugging Face name, and `adapter_config.json`
//! (`r`, `lora_alpha`, `target_modules`, ...), which `peft.PeftModel.from_pretrained` reads over
//! the base model. A collective like `save_hf`: rank 0 gathers and writes.

use std::path::Path;

use oxiflow_dtype::DType;
use oxiflow_placement::Placement;
use serde_json::json;

use crate::nn::Linear;

use super::config::HfConfig;
use super::error::{HfError, HfResult};
use super::names::{NameMap, Take};
use super::save::{agree, assemble, prepare, whole_on_root, write_json, write_shard};

/// The adapter weights' file.
pub const ADAPTER_FILE: &str = "adapter_model.safetensors";
/// The adapter's configuration.
pub const ADAPTER_CONFIG: &str = "adapter_config.json";

/// What `adapter_config.json` records besides the tensors.
#[derive(Clone, Debug)]
pub struct AdapterConfig {
    pub rank: usize,
    pub alpha: f64,
    /// PEFT's `target_modules`: the Hugging Face module names adapted.
    pub target_modules: Vec<String>,
    /// The base model's directory, when known.
    pub base: Option<String>,
}

/// Writes the adapters of `layers` (each with one) to `dir` (created; it must not exist or be
/// empty) under the names of `config`'s family. Every rank calls it alike; rank 0 writes, and
/// its outcome is every rank's.
pub fn save_adapter(
    dir: &Path,
    config: &HfConfig,
    adapter: &AdapterConfig,
    layers: &[&Linear],
) -> HfResult<()> {
    let model_err = |detail: String| HfError::Model {
        path: dir.to_path_buf(),
        detail,
    };
    let ctx =
        oxiflow_tensor::Context::current().ok_or_else(|| model_err("no runtime context".into()))?;
    let lead = ctx.rank() == 0;
    let names = NameMap::new(config.family, config.vocab, |_| true);
    let mut data: Vec<(String, Vec<usize>, Vec<u8>)> = Vec::new();
    let mut dtype = DType::F32;
    let mut written: HfResult<()> = if lead { prepare(dir) } else { Ok(()) };
    let device = layers
        .first()
        .and_then(|l| l.weight.value().placement().map(Placement::device))
        .unwrap_or(oxiflow_placement::DeviceType::Cpu);
    let root =
        Placement::range(device, 1).map_err(|e| model_err(format!("rank 0's placement: {e}")))?;
    for l in layers {
        let Some(lora) = &l.lora else { continue };
        let module = names
            .source(l.weight.name())
            .and_then(|s| s.name.strip_suffix(".weight").map(str::to_string))
            .ok_or_else(|| {
                model_err(format!(
                    "layer {} has no Hugging Face module name",
                    l.weight.name()
                ))
            })?;
        for (p, leaf) in [(&lora.a, "lora_A"), (&lora.b, "lora_B")] {
            let v = p.value();
            dtype = v.dtype();
            let bytes = whole_on_root(&v, &root, lead)?;
            if lead {
                // Ours [a, b]; PEFT's [b, a].
                let shape = Take::Transposed.stored_shape(v.shape().dims());
                let out = assemble(&shape, &[(bytes, Take::Transposed)], dtype.size());
                data.push((
                    format!("base_model.model.{module}.{leaf}.weight"),
                    shape,
                    out,
                ));
            }
        }
    }
    if lead && written.is_ok() {
        written = write_shard(&dir.join(ADAPTER_FILE), dtype, &data).and_then(|_| {
            write_json(
                &dir.join(ADAPTER_CONFIG),
                &json!({
                    "peft_type": "LORA",
                    "task_type": "CAUSAL_LM",
                    "base_model_name_or_path": adapter.base,
                    "r": adapter.rank,
                    "lora_alpha": adapter.alpha,
                    "lora_dropout": 0.0,
                    "target_modules": adapter.target_modules,
                    "bias": "none",
                    "fan_in_fan_out": config.family == super::config::Family::Gpt2,
                    "use_rslora": false,
                    "modules_to_save": null,
                    "inference_mode": true,
                }),
            )
        });
    }
    agree(written, &root, lead, dir)
}
