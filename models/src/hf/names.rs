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
}

impl Take {
    /// The stored tensor's shape for a parameter of `shape`.
    pub fn stored_shape(self, shape: &[usize]) -> Vec<usize> {
        match (self, shape) {
            (Take::Table { vocab }, [_, c]) => vec![vocab, *c],
            (Take::Transposed, [a, b]) => vec![*b, *a],
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
