//! `HfConfig`: a Hugging Face `config.json` as the decoder family reads it (the architecture,
//! its sizes and `Arch`), checked key by key, and written back (`to_json`) in the form
//! transformers reads: the keys this crate sets over those the file had.

use std::path::{Path, PathBuf};

use serde_json::{json, Map, Value};

use crate::nn::gpt::{Arch, GptConfig, MlpKind, MoeArch, NormKind, Positions, RopeScaling};

use super::error::{HfError, HfResult};

/// The architectures the decoder family builds (`config.json`'s `architectures`).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Family {
    Gpt2,
    Llama,
    Qwen2,
    Mistral,
    /// Mistral's attention with a mixture of experts (top-k renormalised) in every block.
    Mixtral,
    /// Qwen2's attention with a mixture of experts and a gated shared expert in every block.
    Qwen2Moe,
}

impl Family {
    pub const ALL: [Family; 6] = [
        Family::Gpt2,
        Family::Llama,
        Family::Qwen2,
        Family::Mistral,
        Family::Mixtral,
        Family::Qwen2Moe,
    ];

    /// The architecture's class name in transformers.
    pub fn architecture(self) -> &'static str {
        match self {
            Family::Gpt2 => "GPT2LMHeadModel",
            Family::Llama => "LlamaForCausalLM",
            Family::Qwen2 => "Qwen2ForCausalLM",
            Family::Mistral => "MistralForCausalLM",
            Family::Mixtral => "MixtralForCausalLM",
            Family::Qwen2Moe => "Qwen2MoeForCausalLM",
        }
    }

    /// `config.json`'s `model_type`.
    pub fn model_type(self) -> &'static str {
        match self {
            Family::Gpt2 => "gpt2",
            Family::Llama => "llama",
            Family::Qwen2 => "qwen2",
            Family::Mistral => "mistral",
            Family::Mixtral => "mixtral",
            Family::Qwen2Moe => "qwen2_moe",
        }
    }

    fn of(name: &str) -> Option<Family> {
        Family::ALL.into_iter().find(|f| f.architecture() == name)
    }

    /// Every supported architecture's name, for error messages.
    pub fn supported() -> String {
        Family::ALL.map(Family::architecture).join(", ")
    }
}

/// A checked `config.json`.
#[derive(Clone, Debug)]
pub struct HfConfig {
    /// The file read (or the one to write).
    pub path: PathBuf,
    pub family: Family,
    pub vocab: usize,
    /// The longest sequence the model takes (GPT-2: rows of its position table).
    pub max_positions: usize,
    pub layers: usize,
    pub heads: usize,
    pub width: usize,
    pub arch: Arch,
    /// The ids that end a generated sequence.
    pub eos: Vec<usize>,
    /// The attention window of a sliding-window model (None: full causal attention).
    pub sliding_window: Option<usize>,
    /// The file's keys as read (kept when written back).
    raw: Map<String, Value>,
}

/// Reads `config.json`'s keys with the file named in every error.
struct Keys<'a> {
    path: &'a Path,
    map: &'a Map<String, Value>,
}

impl Keys<'_> {
    fn err(&self, key: &str, detail: impl Into<String>) -> HfError {
        HfError::Config {
            path: self.path.to_path_buf(),
            key: key.to_string(),
            detail: detail.into(),
        }
    }
    fn get(&self, key: &str) -> Option<&Value> {
        self.map.get(key).filter(|v| !v.is_null())
    }
    fn count(&self, key: &str) -> HfResult<usize> {
        match self.get(key) {
            Some(v) => v
                .as_u64()
                .filter(|&n| n > 0)
                .and_then(|n| usize::try_from(n).ok())
                .ok_or_else(|| self.err(key, format!("{v} is not a count above 0"))),
            None => Err(self.err(key, "missing")),
        }
    }
    fn count_or(&self, key: &str, default: usize) -> HfResult<usize> {
        match self.get(key) {
            Some(_) => self.count(key),
            None => Ok(default),
        }
    }
    fn number_or(&self, key: &str, default: f64) -> HfResult<f64> {
        match self.get(key) {
            Some(v) => v
                .as_f64()
                .filter(|x| x.is_finite())
                .ok_or_else(|| self.err(key, format!("{v} is not a finite number"))),
            None => Ok(default),
        }
    }
    fn flag_or(&self, key: &str, default: bool) -> HfResult<bool> {
        match self.get(key) {
            Some(v) => v
                .as_bool()
                .ok_or_else(|| self.err(key, format!("{v} is not true or false"))),
            None => Ok(default),
        }
    }
    fn text_or<'v>(&'v self, key: &str, default: &'v str) -> HfResult<&'v str> {
        match self.get(key) {
            Some(v) => v
                .as_str()
                .ok_or_else(|| self.err(key, format!("{v} is not a string"))),
            None => Ok(default),
        }
    }
    /// An id or a list of ids (`eos_token_id`).
    fn ids(&self, key: &str) -> HfResult<Vec<usize>> {
        let one = |v: &Value| {
            v.as_u64()
                .and_then(|n| usize::try_from(n).ok())
                .ok_or_else(|| self.err(key, format!("{v} is not a token id")))
        };
        match self.get(key) {
            None => Ok(Vec::new()),
            Some(Value::Array(a)) => a.iter().map(one).collect(),
            Some(v) => Ok(vec![one(v)?]),
        }
    }
}

impl HfConfig {
    /// `dir/config.json`, checked.
    pub fn read(dir: &Path) -> HfResult<HfConfig> {
        let path = dir.join("config.json");
        let text = std::fs::read_to_string(&path).map_err(|source| HfError::Io {
            path: path.clone(),
            source,
        })?;
        let value: Value = serde_json::from_str(&text).map_err(|e| HfError::Format {
            path: path.clone(),
            detail: format!("not JSON: {e}"),
        })?;
        let Value::Object(map) = value else {
            return Err(HfError::Format {
                path,
                detail: "not a JSON object".into(),
            });
        };
        HfConfig::from_map(path, map)
    }

    fn from_map(path: PathBuf, map: Map<String, Value>) -> HfResult<HfConfig> {
        let k = Keys {
            path: &path,
            map: &map,
        };
        let names: Vec<&str> = match k.get("architectures") {
            Some(Value::Array(a)) => a.iter().filter_map(Value::as_str).collect(),
            _ => Vec::new(),
        };
        let family = match names.as_slice() {
            [one] => Family::of(one).ok_or_else(|| HfError::Architecture {
                path: path.clone(),
                found: one.to_string(),
                supported: Family::supported(),
            })?,
            _ => {
                return Err(HfError::Architecture {
                    path: path.clone(),
                    found: format!("{names:?} (architectures must name one)"),
                    supported: Family::supported(),
                })
            }
        };
        let cfg = match family {
            Family::Gpt2 => HfConfig::gpt2(&k)?,
            _ => HfConfig::llama_like(&k, family)?,
        };
        Ok(HfConfig {
            family,
            eos: k.ids("eos_token_id")?,
            raw: map.clone(),
            path,
            ..cfg
        })
    }

    /// An empty configuration of `family` (filled by the readers).
    fn blank(family: Family, arch: Arch) -> HfConfig {
        HfConfig {
            path: PathBuf::new(),
            family,
            vocab: 0,
            max_positions: 0,
            layers: 0,
            heads: 0,
            width: 0,
            arch,
            eos: Vec::new(),
            sliding_window: None,
            raw: Map::new(),
        }
    }

    fn gpt2(k: &Keys) -> HfResult<HfConfig> {
        let act = k.text_or("activation_function", "gelu_new")?;
        if !matches!(act, "gelu_new" | "gelu_pytorch_tanh") {
            return Err(k.err(
                "activation_function",
                format!("{act:?}: only the tanh GELU (gelu_new, gelu_pytorch_tanh) is supported"),
            ));
        }
        if !k.flag_or("scale_attn_weights", true)? {
            return Err(k.err("scale_attn_weights", "false is not supported"));
        }
        if k.flag_or("scale_attn_by_inverse_layer_idx", false)? {
            return Err(k.err("scale_attn_by_inverse_layer_idx", "true is not supported"));
        }
        let width = k.count("n_embd")?;
        let arch = Arch {
            norm_eps: k.number_or("layer_norm_epsilon", 1e-5)?,
            ffn_width: Some(k.count_or("n_inner", 4 * width)?),
            tie_embeddings: k.flag_or("tie_word_embeddings", true)?,
            ..Arch::gpt2()
        };
        let positions = match k.get("n_positions") {
            Some(_) => k.count("n_positions")?,
            None => k.count("n_ctx")?,
        };
        Ok(HfConfig {
            vocab: k.count("vocab_size")?,
            max_positions: positions,
            layers: k.count("n_layer")?,
            heads: k.count("n_head")?,
            width,
            ..HfConfig::blank(Family::Gpt2, arch)
        })
    }

    fn llama_like(k: &Keys, family: Family) -> HfResult<HfConfig> {
        let act = k.text_or("hidden_act", "silu")?;
        if act != "silu" {
            return Err(k.err(
                "hidden_act",
                format!("{act:?}: only silu (SwiGLU) is supported"),
            ));
        }
        let (width, heads) = (k.count("hidden_size")?, k.count("num_attention_heads")?);
        if let Some(hd) = k.get("head_dim") {
            if hd.as_u64() != Some((width / heads) as u64) || !width.is_multiple_of(heads) {
                return Err(k.err(
                    "head_dim",
                    format!(
                        "{hd}: only hidden_size / num_attention_heads ({width} / {heads}) is supported"
                    ),
                ));
            }
        }
        let (qkv_bias, out_bias, mlp_bias) = match family {
            Family::Qwen2 => (true, false, false),
            Family::Qwen2Moe => (k.flag_or("qkv_bias", true)?, false, false),
            Family::Llama => {
                let b = k.flag_or("attention_bias", false)?;
                (b, b, k.flag_or("mlp_bias", false)?)
            }
            _ => (false, false, false),
        };
        let max_positions = k.count("max_position_embeddings")?;
        let arch = Arch {
            norm: NormKind::RmsNorm,
            norm_eps: k.number_or("rms_norm_eps", 1e-6)?,
            positions: rope(k)?,
            mlp: MlpKind::SwiGlu,
            ffn_width: Some(k.count("intermediate_size")?),
            kv_heads: Some(k.count_or("num_key_value_heads", heads)?),
            qkv_bias,
            out_bias,
            mlp_bias,
            tie_embeddings: k.flag_or("tie_word_embeddings", false)?,
            moe: moe(k, family)?,
        };
        Ok(HfConfig {
            vocab: k.count("vocab_size")?,
            max_positions,
            layers: k.count("num_hidden_layers")?,
            heads,
            width,
            sliding_window: sliding_window(k, family)?,
            ..HfConfig::blank(family, arch)
        })
    }

    /// The configuration of a decoder built here, as `family` (`Gpt2` for `Arch::gpt2`-style
    /// models, else a Llama-style family), with the end-of-sequence ids `eos`.
    pub fn of_model(family: Family, cfg: &GptConfig, arch: &Arch, eos: Vec<usize>) -> HfConfig {
        HfConfig {
            vocab: cfg.vocab,
            max_positions: cfg.seq_len,
            layers: cfg.layers,
            heads: cfg.heads,
            width: cfg.width,
            eos,
            ..HfConfig::blank(family, arch.clone())
        }
    }

    /// The decoder sizes of this configuration: `base` (seed, dtype, dropout, vocabulary
    /// padding, sequence parallelism) with the vocabulary, positions, layers, heads and width
    /// from the file.
    pub fn gpt_config(&self, base: &GptConfig) -> GptConfig {
        GptConfig {
            vocab: self.vocab,
            seq_len: self.max_positions,
            layers: self.layers,
            heads: self.heads,
            width: self.width,
            ..base.clone()
        }
    }

    /// Refuses windows of `len` tokens the model cannot take as transformers would run them:
    /// beyond its positions, or beyond a sliding attention window (which this crate does not
    /// implement).
    pub fn check_window(&self, len: usize) -> HfResult<()> {
        if len > self.max_positions {
            let key = match self.family {
                Family::Gpt2 => "n_positions",
                _ => "max_position_embeddings",
            };
            return Err(HfError::Config {
                path: self.path.clone(),
                key: key.into(),
                detail: format!(
                    "{} positions, and a window of {len} tokens needs more",
                    self.max_positions
                ),
            });
        }
        self.check_sliding_window(len)
    }

    /// Refuses sequences of `len` tokens longer than a sliding attention window (which this
    /// crate does not implement: up to the window, attention is the same).
    pub fn check_sliding_window(&self, len: usize) -> HfResult<()> {
        match self.sliding_window {
            Some(w) if len > w => Err(HfError::Config {
                path: self.path.clone(),
                key: "sliding_window".into(),
                detail: format!(
                    "sliding-window attention of {w} tokens matters for windows of {len} tokens \
                     and is not supported (windows of at most {w} tokens are exact)"
                ),
            }),
            _ => Ok(()),
        }
    }

    /// The configuration as transformers reads it, with tensors stored as `dtype` (a
    /// safetensors name: `F32`, ...): the file's keys as read, with every key this crate
    /// decides set over them.
    pub fn to_json(&self, dtype: &str) -> Value {
        let mut m = self.raw.clone();
        let torch = match dtype {
            "F64" => "float64",
            "BF16" => "bfloat16",
            "F16" => "float16",
            _ => "float32",
        };
        let mut set = |k: &str, v: Value| {
            m.insert(k.to_string(), v);
        };
        set("architectures", json!([self.family.architecture()]));
        set("model_type", json!(self.family.model_type()));
        set("vocab_size", json!(self.vocab));
        set("dtype", json!(torch));
        set("torch_dtype", json!(torch));
        set("tie_word_embeddings", json!(self.arch.tie_embeddings));
        match self.eos.as_slice() {
            [] => {}
            [one] => set("eos_token_id", json!(one)),
            many => set("eos_token_id", json!(many)),
        }
        let a = &self.arch;
        let ffn = a.ffn_width.unwrap_or(4 * self.width);
        match self.family {
            Family::Gpt2 => {
                set("n_positions", json!(self.max_positions));
                set("n_ctx", json!(self.max_positions));
                set("n_embd", json!(self.width));
                set("n_layer", json!(self.layers));
                set("n_head", json!(self.heads));
                set("n_inner", json!(ffn));
                set("layer_norm_epsilon", json!(a.norm_eps));
                set("activation_function", json!("gelu_new"));
                for p in ["resid_pdrop", "embd_pdrop", "attn_pdrop"] {
                    set(p, json!(0.0));
                }
            }
            _ => {
                set("hidden_size", json!(self.width));
                set("intermediate_size", json!(ffn));
                set("num_hidden_layers", json!(self.layers));
                set("num_attention_heads", json!(self.heads));
                set(
                    "num_key_value_heads",
                    json!(a.kv_heads.unwrap_or(self.heads)),
                );
                set("head_dim", json!(self.width / self.heads.max(1)));
                set("hidden_act", json!("silu"));
                set("max_position_embeddings", json!(self.max_positions));
                set("rms_norm_eps", json!(a.norm_eps));
                if self.family == Family::Llama {
                    set("attention_bias", json!(a.qkv_bias));
                    set("mlp_bias", json!(a.mlp_bias));
                }
                if let Some(moe) = &a.moe {
                    set("num_experts_per_tok", json!(moe.top_k));
                    set("router_aux_loss_coef", json!(moe.aux_loss_coef));
                    if self.family == Family::Mixtral {
                        set("num_local_experts", json!(moe.experts));
                        set("intermediate_size", json!(moe.expert_width));
                        set("router_jitter_noise", json!(0.0));
                    } else {
                        set("num_experts", json!(moe.experts));
                        set("norm_topk_prob", json!(moe.renormalize));
                        set("moe_intermediate_size", json!(moe.expert_width));
                        set(
                            "shared_expert_intermediate_size",
                            json!(moe.shared_width.unwrap_or(0)),
                        );
                        set("decoder_sparse_step", json!(1));
                        set("mlp_only_layers", json!([]));
                        set("qkv_bias", json!(a.qkv_bias));
                    }
                }
                if let Positions::Rotary { theta, scaling } = a.positions {
                    let mut params = rope_json(scaling);
                    set("rope_theta", json!(theta));
                    set(
                        "rope_scaling",
                        if scaling == RopeScaling::None {
                            Value::Null
                        } else {
                            Value::Object(params.clone())
                        },
                    );
                    params.insert("rope_theta".into(), json!(theta));
                    set("rope_parameters", Value::Object(params));
                }
            }
        }
        Value::Object(m)
    }
}

/// The rope type and scaling keys of `scaling`, as transformers names them.
fn rope_json(scaling: RopeScaling) -> Map<String, Value> {
    let v = match scaling {
        RopeScaling::None => json!({"rope_type": "default"}),
        RopeScaling::Linear { factor } => json!({"rope_type": "linear", "factor": factor}),
        RopeScaling::Llama3 {
            factor,
            low_freq_factor,
            high_freq_factor,
            original_max_positions,
        } => json!({
            "rope_type": "llama3",
            "factor": factor,
            "low_freq_factor": low_freq_factor,
            "high_freq_factor": high_freq_factor,
            "original_max_position_embeddings": original_max_positions,
        }),
    };
    match v {
        Value::Object(m) => m,
        _ => Map::new(),
    }
}

/// The rotary positions: `rope_parameters` (transformers 5) or `rope_theta` with
/// `rope_scaling` (earlier); types `default`, `linear` and `llama3`.
fn rope(k: &Keys) -> HfResult<Positions> {
    let (key, params) = match (k.get("rope_parameters"), k.get("rope_scaling")) {
        (Some(p), _) => ("rope_parameters", Some(p)),
        (None, s) => ("rope_scaling", s),
    };
    let empty = Map::new();
    let params = match params {
        Some(Value::Object(m)) => m,
        Some(v) => return Err(k.err(key, format!("{v} is not an object"))),
        None => &empty,
    };
    let p = Keys {
        path: k.path,
        map: params,
    };
    let theta = match p.get("rope_theta") {
        Some(_) => p.number_or("rope_theta", 0.0)?,
        None => k.number_or("rope_theta", 10000.0)?,
    };
    if p.number_or("partial_rotary_factor", 1.0)? != 1.0 {
        return Err(k.err(key, "partial_rotary_factor other than 1 is not supported"));
    }
    let kind = match p.get("rope_type") {
        Some(_) => p.text_or("rope_type", "default")?,
        None => p.text_or("type", "default")?,
    };
    let named = |what: &str| format!("{key}.{what}");
    let factor = || -> HfResult<f64> {
        p.get("factor")
            .and_then(Value::as_f64)
            .ok_or_else(|| k.err(&named("factor"), "missing or not a number"))
    };
    let scaling = match kind {
        "default" => RopeScaling::None,
        "linear" => RopeScaling::Linear { factor: factor()? },
        "llama3" => RopeScaling::Llama3 {
            factor: factor()?,
            low_freq_factor: p.number_or("low_freq_factor", f64::NAN)?,
            high_freq_factor: p.number_or("high_freq_factor", f64::NAN)?,
            original_max_positions: p
                .count("original_max_position_embeddings")
                .map_err(|_| k.err(&named("original_max_position_embeddings"), "missing"))?,
        },
        other => {
            return Err(k.err(
                &named("rope_type"),
                format!("{other:?} is not supported (supported: default, linear, llama3)"),
            ))
        }
    };
    Ok(Positions::Rotary { theta, scaling })
}

/// The mixture of experts of a Mixtral or Qwen2-MoE configuration (None for the dense
/// families). Layouts this crate does not build (dense layers among sparse ones, router
/// jitter) are refused by key.
fn moe(k: &Keys, family: Family) -> HfResult<Option<MoeArch>> {
    if !matches!(family, Family::Mixtral | Family::Qwen2Moe) {
        return Ok(None);
    }
    let coef = k.number_or("router_aux_loss_coef", 0.001)?;
    let top_k = k.count("num_experts_per_tok")?;
    let moe = match family {
        Family::Mixtral => {
            if k.number_or("router_jitter_noise", 0.0)? != 0.0 {
                return Err(k.err("router_jitter_noise", "router jitter is not supported"));
            }
            MoeArch {
                experts: k.count("num_local_experts")?,
                top_k,
                renormalize: true,
                expert_width: k.count("intermediate_size")?,
                shared_width: None,
                aux_loss_coef: coef,
            }
        }
        Family::Qwen2Moe => {
            if k.count_or("decoder_sparse_step", 1)? != 1 {
                return Err(k.err(
                    "decoder_sparse_step",
                    "only 1 (every layer sparse) is supported",
                ));
            }
            match k.get("mlp_only_layers") {
                None => {}
                Some(Value::Array(a)) if a.is_empty() => {}
                Some(v) => {
                    return Err(k.err(
                        "mlp_only_layers",
                        format!("{v}: dense layers among sparse ones are not supported"),
                    ))
                }
            }
            MoeArch {
                experts: k.count("num_experts")?,
                top_k,
                renormalize: k.flag_or("norm_topk_prob", false)?,
                expert_width: k.count("moe_intermediate_size")?,
                shared_width: Some(k.count("shared_expert_intermediate_size")?),
                aux_loss_coef: coef,
            }
        }
        _ => return Ok(None),
    };
    if moe.top_k > moe.experts {
        return Err(k.err(
            "num_experts_per_tok",
            format!("{} is above the expert count {}", moe.top_k, moe.experts),
        ));
    }
    if coef < 0.0 {
        return Err(k.err("router_aux_loss_coef", format!("{coef} is below 0")));
    }
    Ok(Some(moe))
}

/// The window of sliding-window attention, where a layer uses it: Mistral's
/// `sliding_window`; Qwen2's under `use_sliding_window` (or a `layer_types` entry).
fn sliding_window(k: &Keys, family: Family) -> HfResult<Option<usize>> {
    let used = match family {
        Family::Mistral | Family::Mixtral => true,
        Family::Qwen2 | Family::Qwen2Moe => {
            let typed = match k.get("layer_types") {
                Some(Value::Array(a)) => a.iter().any(|t| t.as_str() == Some("sliding_attention")),
                _ => false,
            };
            typed || k.flag_or("use_sliding_window", false)?
        }
        _ => false,
    };
    // An unused window's key (Qwen2-MoE saves 0) is not read.
    if !used {
        return Ok(None);
    }
    Ok(match k.get("sliding_window") {
        Some(_) => Some(k.count("sliding_window")?),
        None => None,
    })
}
