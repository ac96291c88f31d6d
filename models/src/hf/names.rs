//! Where each parameter of a decoder lives in a Hugging Face checkpoint of its family: the
//! tensor's name and how its elements map onto the parameter's (`Take`). Linear weights are
//! `[in, out]` here; transformers' `nn.Linear` stores `[out, in]` (transposed), GPT-2's
//! `Conv1D` stores `[in, out]` with Q, K and V side by side in one `c_attn` (columns).

use super::config::Family;

/// How a checkpoint tensor's elements map onto a parameter's.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Take {
    /// The same shape and order.
    Same,
    /// A token table: the checkpoint's `[vocab, C]` are the parameter's first rows (the rest,
    /// the vocabulary's padding, are zeros).
    Table { vocab: usize },
    /// A 2-d parameter `[a, b]` stored as `[b, a]`.
    Transposed,
    /// Part `index` of `parts` equal parts of the last dim: a parameter `[a, b]` is columns
    /// `[index b, (index + 1) b)` of a stored `[a, parts b]` (`[parts b]` for a 1-d one).
    Part { index: usize, parts: usize },
    /// Expert `index`'s slice `[a, b]` of a stacked `[experts, a, b]` parameter, stored as
    /// `[b, a]` in a tensor of its own.
    Expert { index: usize },
}

impl Take {
    /// The stored tensor's shape for a parameter of `shape`.
    pub fn stored_shape(self, shape: &[usize]) -> Vec<usize> {
        match (self, shape) {
            (Take::Table { vocab }, [_, c]) => vec![vocab, *c],
            (Take::Transposed, [a, b]) | (Take::Expert { .. }, [_, a, b]) => vec![*b, *a],
            (Take::Part { parts, .. }, [a, b]) => vec![*a, parts * b],
            (Take::Part { parts, .. }, [b]) => vec![parts * b],
            _ => shape.to_vec(),
        }
    }
}

/// A parameter's source: the checkpoint tensor `name`, taken as `take`.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Source {
    pub name: String,
    pub take: Take,
}

/// The names of one family's checkpoints. GPT-2's carry `prefix` (`transformer.`, as
/// transformers saves them, or nothing, as the original release has them).
#[derive(Clone, Debug)]
pub struct NameMap {
    family: Family,
    prefix: String,
    vocab: usize,
}

impl NameMap {
    /// The names of `family` with the vocabulary `vocab`; for GPT-2, `has` says whether a
    /// checkpoint tensor exists, and decides the prefix.
    pub fn new(family: Family, vocab: usize, has: impl Fn(&str) -> bool) -> NameMap {
        let prefix = match family {
            Family::Gpt2 if !has("transformer.wte.weight") && has("wte.weight") => "",
            Family::Gpt2 => "transformer.",
            _ => "model.",
        };
        NameMap {
            family,
            prefix: prefix.to_string(),
            vocab,
        }
    }

    /// The source of parameter `param` (None: a name no decoder of this family has).
    /// The sources of parameter `param` of `shape`: one tensor, or one per expert of a
    /// mixture's stacked expert matrices (`h.L.mlp.experts.{gate,up,down}.weight`).
    pub fn sources(&self, param: &str, shape: &[usize]) -> Option<Vec<Source>> {
        let stacked = param
            .strip_prefix("h.")
            .and_then(|r| r.split_once(".mlp.experts."))
            .and_then(|(layer, r)| {
                Some((layer.parse::<usize>().ok()?, r.strip_suffix(".weight")?))
            });
        match (stacked, shape) {
            (Some((layer, proj)), [experts, _, _]) => (0..*experts)
                .map(|e| {
                    let module = format!("mlp.experts.{e}.{proj}");
                    Some(Source {
                        name: format!(
                            "{}layers.{layer}.{}.weight",
                            self.prefix,
                            self.expert_tensor(&module)?
                        ),
                        take: Take::Expert { index: e },
                    })
                })
                .collect(),
            _ => self.source(param).map(|s| vec![s]),
        }
    }

    pub fn source(&self, param: &str) -> Option<Source> {
        let (p, table) = (&self.prefix, Take::Table { vocab: self.vocab });
        let src = |name: String, take: Take| Some(Source { name, take });
        match param {
            "wte.weight" => match self.family {
                Family::Gpt2 => src(format!("{p}wte.weight"), table),
                _ => src(format!("{p}embed_tokens.weight"), table),
            },
            "wpe.weight" => src(format!("{p}wpe.weight"), Take::Same),
            "lm_head.weight" => src("lm_head.weight".into(), table),
            _ => {
                if let Some(rest) = param.strip_prefix("ln_f.") {
                    return match self.family {
                        Family::Gpt2 => src(format!("{p}ln_f.{rest}"), Take::Same),
                        _ => src(format!("{p}norm.{rest}"), Take::Same),
                    };
                }
                let rest = param.strip_prefix("h.")?;
                let (layer, rest) = rest.split_once('.')?;
                let layer: usize = layer.parse().ok()?;
                let (module, leaf) = rest.rsplit_once('.')?;
                match self.family {
                    Family::Gpt2 => self.gpt2_block(layer, module, leaf),
                    _ => self.llama_block(layer, module, leaf),
                }
            }
        }
    }

    fn gpt2_block(&self, layer: usize, module: &str, leaf: &str) -> Option<Source> {
        let at = format!("{}h.{layer}.", self.prefix);
        let (name, take) = match module {
            "ln1" => ("ln_1", Take::Same),
            "ln2" => ("ln_2", Take::Same),
            "attn.q" => ("attn.c_attn", Take::Part { index: 0, parts: 3 }),
            "attn.k" => ("attn.c_attn", Take::Part { index: 1, parts: 3 }),
            "attn.v" => ("attn.c_attn", Take::Part { index: 2, parts: 3 }),
            "attn.proj" => ("attn.c_proj", Take::Same),
            "mlp.fc" => ("mlp.c_fc", Take::Same),
            "mlp.proj" => ("mlp.c_proj", Take::Same),
            _ => return None,
        };
        Some(Source {
            name: format!("{at}{name}.{leaf}"),
            take,
        })
    }

    fn llama_block(&self, layer: usize, module: &str, leaf: &str) -> Option<Source> {
        let at = format!("{}layers.{layer}.", self.prefix);
        if let Some(name) = self.expert_tensor(module) {
            return Some(Source {
                name: format!("{at}{name}.{leaf}"),
                take: Take::Transposed,
            });
        }
        let name = match module {
            "ln1" => "input_layernorm",
            "ln2" => "post_attention_layernorm",
            "attn.q" => "self_attn.q_proj",
            "attn.k" => "self_attn.k_proj",
            "attn.v" => "self_attn.v_proj",
            "attn.proj" => "self_attn.o_proj",
            "mlp.gate" => "mlp.gate_proj",
            "mlp.up" => "mlp.up_proj",
            "mlp.down" => "mlp.down_proj",
            _ => return None,
        };
        let take = match (module, leaf) {
            ("ln1" | "ln2", _) | (_, "bias") => Take::Same,
            _ => Take::Transposed,
        };
        Some(Source {
            name: format!("{at}{name}.{leaf}"),
            take,
        })
    }

    /// The checkpoint module of a mixture-of-experts parameter's module (`mlp.router`,
    /// `mlp.experts.E.{gate,up,down}`, `mlp.shared.{gate,up,down}`, `mlp.shared_gate`): Mixtral's
    /// `block_sparse_moe.gate` and `experts.E.w1/w3/w2`, Qwen2-MoE's `mlp.gate`,
    /// `mlp.experts.E.*_proj`, `mlp.shared_expert.*_proj` and `mlp.shared_expert_gate`.
    fn expert_tensor(&self, module: &str) -> Option<String> {
        let rest = module.strip_prefix("mlp.")?;
        let proj = |p: &str| match (self.family, p) {
            (Family::Mixtral, "gate") => Some("w1"),
            (Family::Mixtral, "up") => Some("w3"),
            (Family::Mixtral, "down") => Some("w2"),
            (Family::Qwen2Moe, "gate") => Some("gate_proj"),
            (Family::Qwen2Moe, "up") => Some("up_proj"),
            (Family::Qwen2Moe, "down") => Some("down_proj"),
            _ => None,
        };
        let sparse = match self.family {
            Family::Mixtral => "block_sparse_moe",
            Family::Qwen2Moe => "mlp",
            _ => return None,
        };
        if rest == "router" {
            return Some(format!("{sparse}.gate"));
        }
        if let Some(e) = rest.strip_prefix("experts.") {
            let (e, p) = e.split_once('.')?;
            let e: usize = e.parse().ok()?;
            return Some(format!("{sparse}.experts.{e}.{}", proj(p)?));
        }
        match (self.family, rest) {
            (Family::Qwen2Moe, "shared_gate") => Some("mlp.shared_expert_gate".into()),
            (Family::Qwen2Moe, r) => {
                let p = r.strip_prefix("shared.")?;
                Some(format!("mlp.shared_expert.{}", proj(p)?))
            }
            _ => None,
        }
    }

    /// Whether a checkpoint tensor no parameter reads may be left unread: buffers older saves
    /// kept (GPT-2's causal masks, rotary frequencies) and a tied model's copy of its output
    /// table.
    pub fn ignorable(&self, name: &str, tied: bool) -> bool {
        name.ends_with(".attn.bias") && self.family == Family::Gpt2
            || name.ends_with(".attn.masked_bias")
            || name.ends_with("rotary_emb.inv_freq")
            || (tied && name == "lm_head.weight")
    }
}
