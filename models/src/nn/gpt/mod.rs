//! The decoder family on global tensors: GPT-2, Llama, Qwen2, Mistral, Mixtral and Qwen2-MoE
//! are one model
//! (`Gpt`) parameterised by `Arch` (norm, positions, MLP, grouped-query attention, biases,
//! tied or untied output table) over the sizes of `GptConfig` (the vocabulary padded to an
//! aligned table, the padding outside the loss). On a `[dp, tp]` mesh the batch is split over `dp`; Megatron tensor
//! parallelism follows from the parameters' SBP on `tp` (Q, K, V and the first MLP matrix
//! column-parallel, the output projections row-parallel, heads split); sequence parallelism
//! splits the residual stream along the sequence on `tp` between the parallel regions. A
//! `StageSplit` puts chunks of blocks on pipeline stages (one `[dp, tp]` layout each). LoRA
//! adapters (`LoraSpec`) go on the blocks' linear layers, the base frozen.

mod arch;
mod attention;
mod block;
mod config;
mod decode;
mod fused_gate_up;
mod fused_qkv;
mod lora;
mod mlp;
mod model;
mod moe;
mod norm;
mod rope;
mod stages;

pub use super::Pass;
pub use arch::{Arch, MlpKind, MoeArch, NormKind, Positions, RopeScaling, LN_EPS};
pub use attention::{causal_attention, repeat_heads, CausalSelfAttention, KvSlot};
pub use block::{Block, BlockMlp, Recompute};
pub use config::{padded_vocab, GptConfig, GptLayout, DEFAULT_VOCAB_MULTIPLE};
pub use decode::{DecodeWeights, FixedKvCache, KvCache};
pub use fused_gate_up::FusedGateUp;
pub use fused_qkv::FusedQkv;
pub use lora::LoraSpec;
pub use mlp::GptMlp;
pub use model::{Gpt, HEAD_TABLE, TOKEN_TABLE};
pub use moe::{MoeMlp, RouterLog, RouterStats};
pub use norm::Norm;
pub use rope::Rope;
pub use stages::StageSplit;
