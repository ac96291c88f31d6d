//! A GPT-2 style language model on global tensors: pre-LN blocks, learned positions, tied
//! input/output embedding (the vocabulary padded to an aligned table, the padding outside the
//! loss). On a `[dp, tp]` mesh the batch is split over `dp`; Megatron tensor
//! parallelism follows from the parameters' SBP on `tp` (Q, K, V and the first MLP matrix
//! column-parallel, the output projections row-parallel, heads split); sequence parallelism
//! splits the residual stream along the sequence on `tp` between the parallel regions. A
//! `StageSplit` puts chunks of blocks on pipeline stages (one `[dp, tp]` layout each).

mod attention;
mod block;
mod config;
mod model;
mod stages;

pub use super::Pass;
pub use attention::{causal_attention, CausalSelfAttention};
pub use block::{Block, GptMlp, Recompute, LN_EPS};
pub use config::{padded_vocab, GptConfig, GptLayout, DEFAULT_VOCAB_MULTIPLE, DP_AXIS, TP_AXIS};
pub use model::{Gpt, TOKEN_TABLE};
pub use stages::StageSplit;
