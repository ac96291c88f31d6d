//! Hugging Face model directories in and out of the decoder family (`nn::gpt`): `config.json`
//! read into a family (`GPT2LMHeadModel`, `LlamaForCausalLM`, `Qwen2ForCausalLM`,
//! `MistralForCausalLM`, and the mixtures of experts `MixtralForCausalLM` and
//! `Qwen2MoeForCausalLM`), sizes and `Arch` (`config`); each parameter's tensor name and layout
//! in the family's checkpoints (`names`: GPT-2's fused `c_attn` Conv1D split into Q, K and V,
//! `nn.Linear` weights transposed, each expert's matrices under its own name); the weights (`model.safetensors` or the shards of
//! `model.safetensors.index.json`, F32/F64/BF16/F16) memory-mapped, every name, shape and dtype
//! checked before anything is read, and each rank reading only the byte ranges of its own
//! regions (`files`, `load`); and the inverse, a directory transformers loads (`save`), or a model's LoRA adapters alone
//! in PEFT's layout (`adapter`).
//! Every mismatch is an `HfError` naming the file and the tensor.

mod adapter;
mod config;
mod error;
mod files;
mod load;
mod names;
mod save;

pub use adapter::{save_adapter, AdapterConfig, ADAPTER_CONFIG, ADAPTER_FILE};
pub use config::{Family, HfConfig};
pub use error::{HfError, HfResult};
pub use files::{HfWeights, Stored, INDEX_FILE, WEIGHTS_FILE};
pub use load::HfCheckpoint;
pub use names::{NameMap, Source, Take};
pub use save::save_hf;
