//! `Flags`: every setting of a training job as it is written, on the command line
//! (`--seq-len 64`) or in a job file (`seq-len = 64` in the `[model]` table): optional values
//! in sections; `resolve` turns them into a checked `TrainConfig`. The same key names serve
//! both, so a printed configuration is a valid job file.

use std::path::PathBuf;

use clap::{Args, ValueEnum};
use oxiflow_dtype::{DType, MatmulPrecision, MixedPrecision, PrecisionError};
use oxiflow_models::nn::gpt::Recompute;
use serde::{Deserialize, Serialize};

use super::checks::parse;
use super::tokenizer::TokenizerArg;

/// The model a job trains.
#[derive(Clone, Copy, Debug, PartialEq, Eq, ValueEnum, Serialize, Deserialize)]
#[serde(rename_all = "kebab-case")]
pub enum ModelKind {
    /// A GPT-2 style language model on text or token shards.
    Gpt,
    /// A Llama-style decoder (RMSNorm, rotary positions, SwiGLU, grouped-query attention, an
    /// output table of its own unless --tie-embeddings) on the GPT's data.
    Llama,
    /// The MLP classifier on Gaussian clusters.
    Mlp,
}

impl ModelKind {
    /// Whether the model is a decoder of the GPT family (GPT or Llama).
    pub fn is_decoder(self) -> bool {
        matches!(self, ModelKind::Gpt | ModelKind::Llama)
    }
}

/// What each GPT block keeps for its backward pass.
#[derive(Clone, Copy, Debug, PartialEq, Eq, ValueEnum, Serialize, Deserialize)]
#[serde(rename_all = "kebab-case")]
pub enum RecomputeArg {
    None,
    Full,
    Selective,
    /// The MLP's GELU output, computed again from its pre-activation.
    Gelu,
}

impl From<RecomputeArg> for Recompute {
    fn from(r: RecomputeArg) -> Self {
        match r {
            RecomputeArg::None => Recompute::None,
            RecomputeArg::Full => Recompute::Full,
            RecomputeArg::Selective => Recompute::Selective,
            RecomputeArg::Gelu => Recompute::Gelu,
        }
    }
}

/// How attention runs over a sequence split on the context-parallel axis.
#[derive(Clone, Copy, Debug, PartialEq, Eq, ValueEnum, Serialize, Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum CpAttentionArg {
    /// K/V blocks passed rank to rank around the context-parallel ranks.
    Ring,
    /// Heads <-> sequence all-to-all (DeepSpeed-Ulysses); heads and kv heads divisible by the
    /// ranks they split over.
    Alltoall,
}

/// The order of a pipeline's micro-batches.
#[derive(Clone, Copy, Debug, PartialEq, Eq, ValueEnum, Serialize, Deserialize)]
pub enum ScheduleArg {
    /// All forwards, then all backwards.
    #[serde(rename = "gpipe")]
    Gpipe,
    /// A warm-up of forwards, then one forward and one backward in turn.
    #[value(name = "1f1b")]
    #[serde(rename = "1f1b")]
    OneFOneB,
    /// 1F1B over --virtual-stages chunks per stage (Megatron's interleaved schedule).
    #[serde(rename = "interleaved")]
    Interleaved,
}

/// The optimizer.
#[derive(Clone, Copy, Debug, PartialEq, Eq, ValueEnum, Serialize, Deserialize)]
#[serde(rename_all = "kebab-case")]
pub enum Opt {
    Sgd,
    Adamw,
}

/// Where the model lives.
#[derive(Clone, Copy, Debug, PartialEq, Eq, ValueEnum, Serialize, Deserialize)]
#[serde(rename_all = "kebab-case")]
pub enum Dev {
    /// cuda when the world runs on NCCL (oflaunch --backend auto on a GPU machine), else cpu.
    Auto,
    Cpu,
    Cuda,
}

/// The backend of the world.
#[derive(Clone, Copy, Debug, PartialEq, Eq, ValueEnum, Serialize, Deserialize)]
#[serde(rename_all = "kebab-case")]
pub enum WorldBackend {
    /// As the launch environment says (OXIFLOW_BACKEND, which oflaunch --backend sets).
    Auto,
    /// CPU processes over TCP and shared memory.
    Cpu,
    /// CPU processes over MPI (start with mpirun or srun; needs a build with --features mpi).
    Mpi,
}

/// The precision policy (`--precision`), made into the one `MixedPrecision` value by
/// `TrainConfig::precision` with `--dtype` and `--reduce-dtype` as overrides of its fields.
#[derive(Clone, Copy, Debug, PartialEq, Eq, ValueEnum, Serialize, Deserialize)]
#[serde(rename_all = "kebab-case")]
pub enum PrecisionPolicy {
    /// Everything in f32.
    F32,
    /// Everything in f64.
    F64,
    /// As f32, with f32 matrix products on TF32 tensor cores (cuda only).
    Tf32,
    /// Master weights, gradients and optimizer state in `--dtype`; layers compute with bf16
    /// copies of the parameters and bf16 activations (matrix products and attention accumulate
    /// in f32, norms, softmax and the loss compute in f32).
    Bf16Mixed,
}

impl PrecisionPolicy {
    /// The name `--precision` takes.
    pub fn as_str(self) -> &'static str {
        match self {
            PrecisionPolicy::F32 => "f32",
            PrecisionPolicy::F64 => "f64",
            PrecisionPolicy::Tf32 => "tf32",
            PrecisionPolicy::Bf16Mixed => "bf16-mixed",
        }
    }
    /// The master weights' dtype the policy names (None: bf16-mixed, over `--dtype`).
    pub fn param(self) -> Option<DType> {
        match self {
            PrecisionPolicy::F32 | PrecisionPolicy::Tf32 => Some(DType::F32),
            PrecisionPolicy::F64 => Some(DType::F64),
            PrecisionPolicy::Bf16Mixed => None,
        }
    }
    /// The policy's value over master weights in `param` (where the policy names a dtype,
    /// everything is in `param`: `resolve` refuses a `--dtype` other than the named one).
    pub fn with_param(self, param: DType) -> Result<MixedPrecision, PrecisionError> {
        match self {
            PrecisionPolicy::F32 | PrecisionPolicy::F64 => MixedPrecision::full(param),
            PrecisionPolicy::Tf32 => {
                MixedPrecision::full(param).and_then(|p| p.with_matmul(MatmulPrecision::Tf32))
            }
            PrecisionPolicy::Bf16Mixed => MixedPrecision::bf16_mixed(param),
        }
    }
}

/// The layout of token shard files.
#[derive(Clone, Copy, Debug, PartialEq, Eq, ValueEnum, Serialize, Deserialize)]
#[serde(rename_all = "kebab-case")]
pub enum ShardFormatArg {
    /// llm.c when the first shard starts with its magic, else raw; all shards alike.
    Auto,
    /// nanoGPT: little-endian u16 ids only.
    Raw,
    /// llm.c: 256 little-endian i32 (magic, version, token count), then the ids: u16 under
    /// magic 20240520 version 1 (GPT-2), u32 under magic 20240801 version 7 (Llama 3).
    Llmc,
}

/// The learning-rate schedule after the warm-up.
#[derive(Clone, Copy, Debug, PartialEq, Eq, ValueEnum, Serialize, Deserialize)]
#[serde(rename_all = "kebab-case")]
pub enum LrScheduleArg {
    Constant,
    /// Half a cosine from --lr down to --min-lr at --steps.
    Cosine,
    /// A straight line from --lr down to --min-lr at --steps.
    Linear,
}

/// What a step whose loss or gradient norm is not finite does.
#[derive(Clone, Copy, Debug, PartialEq, Eq, ValueEnum, Serialize, Deserialize)]
#[serde(rename_all = "kebab-case")]
pub enum NonFiniteArg {
    /// Stop the run with an error naming the step and the first non-finite tensor.
    Stop,
    /// Drop the step's update and go on (10 such steps in a row stop the run).
    Skip,
}

/// The model: which one and its sizes.
#[derive(Args, Clone, Debug, Default, Serialize, Deserialize)]
#[serde(deny_unknown_fields, rename_all = "kebab-case")]
pub struct ModelFlags {
    /// The model to train [default: gpt].
    #[arg(long, value_enum)]
    pub model: Option<ModelKind>,
    /// GPT: transformer blocks [default: 2].
    #[arg(long, value_parser = parse::positive_usize)]
    pub layers: Option<usize>,
    /// GPT: attention heads (a multiple of --tp; divides --width) [default: 4].
    #[arg(long, value_parser = parse::positive_usize)]
    pub heads: Option<usize>,
    /// GPT: model width [default: 64].
    #[arg(long, value_parser = parse::positive_usize)]
    pub width: Option<usize>,
    /// GPT: tokens per training window [default: 64].
    #[arg(long, value_parser = parse::positive_usize)]
    pub seq_len: Option<usize>,
    /// GPT: the token table's rows are the vocabulary rounded up to a multiple of this (GPT-2's
    /// 50257 -> 50304, an aligned width for the logits' product); the padding is outside the
    /// loss and generation, so the curve is the unpadded one's. 1: no padding [default: 64].
    #[arg(long, value_parser = parse::positive_usize)]
    pub vocab_multiple: Option<usize>,
    /// GPT: dropout probability, in [0, 1) [default: 0].
    #[arg(long, value_parser = parse::unit_fraction, allow_hyphen_values = true)]
    pub dropout: Option<f64>,
    /// MLP: width of the hidden layer (split over the tensor-parallel axis) [default: 64].
    #[arg(long, value_parser = parse::positive_usize)]
    pub hidden: Option<usize>,
    /// MLP: number of input features [default: 16].
    #[arg(long, value_parser = parse::positive_usize)]
    pub features: Option<usize>,
    /// MLP: number of classes (at least 2) [default: 4].
    #[arg(long, value_parser = parse::class_count)]
    pub classes: Option<usize>,
    /// Element type of the model's master weights and data: f32 or f64 (the policy's
    /// `param` field) [default: the --precision policy's, f32].
    #[arg(long, value_parser = parse::param_dtype)]
    pub dtype: Option<DType>,
    /// Seed of the initial weights, the data and dropout [default: 0].
    #[arg(long, value_parser = parse::u64_any)]
    pub seed: Option<u64>,
    /// Llama: key/value heads, shared by groups of query heads (divides --heads) [default:
    /// --heads].
    #[arg(long, value_parser = parse::positive_usize)]
    pub kv_heads: Option<usize>,
    /// Llama: the MLP's hidden width [default: 4 x --width].
    #[arg(long, value_parser = parse::positive_usize)]
    pub ffn_width: Option<usize>,
    /// Llama: the rotary embedding's base [default: 10000].
    #[arg(long, value_parser = parse::positive_finite)]
    pub rope_theta: Option<f64>,
    /// Llama: RMSNorm's epsilon [default: 1e-5].
    #[arg(long, value_parser = parse::positive_finite)]
    pub norm_eps: Option<f64>,
    /// Llama: the output projection is the token table.
    #[arg(long)]
    #[serde(default, skip_serializing_if = "std::ops::Not::not")]
    pub tie_embeddings: bool,
    /// A Hugging Face model directory (config.json; model.safetensors or its sharded index):
    /// the architecture (GPT2LMHeadModel, LlamaForCausalLM, Qwen2ForCausalLM,
    /// MistralForCausalLM, MixtralForCausalLM, Qwen2MoeForCausalLM), its sizes and its
    /// weights, each rank reading only its own pieces.
    #[arg(long)]
    pub from_hf: Option<PathBuf>,
    /// LoRA fine-tuning: freeze every weight and train rank-R adapters `W + (alpha/R) B A` on the
    /// --lora-targets layers (R at least 1, at most min(in, out) of each).
    #[arg(long, value_parser = parse::positive_usize)]
    pub lora_rank: Option<usize>,
    /// LoRA: the adapters' scale is alpha / rank [default: 8, PEFT's].
    #[arg(long, value_parser = parse::positive_finite)]
    pub lora_alpha: Option<f64>,
    /// LoRA: the adapted layers, comma-separated: q,k,v,o,gate,up,down (Llama, Qwen2,
    /// Mistral; or PEFT's q_proj ... down_proj), c_fc,c_proj (GPT-2) [default: q,v (GPT-2:
    /// c_fc,c_proj)].
    #[arg(long)]
    pub lora_targets: Option<String>,
    /// LoRA: dropout on the adapters' input; only 0 is supported [default: 0].
    #[arg(long, value_parser = parse::unit_fraction, allow_hyphen_values = true)]
    pub lora_dropout: Option<f64>,
}

/// How the job is laid out on the ranks.
#[derive(Args, Clone, Debug, Default, Serialize, Deserialize)]
#[serde(deny_unknown_fields, rename_all = "kebab-case")]
pub struct ParallelFlags {
    /// Data-parallel degree, at least 1 [default: world size / (pp x cp x tp)]; pp x dp x cp x
    /// tp must equal the world size.
    #[arg(long, value_parser = parse::positive_usize)]
    pub dp: Option<usize>,
    /// Tensor-parallel degree, at least 1 [default: 1].
    #[arg(long, value_parser = parse::positive_usize)]
    pub tp: Option<usize>,
    /// GPT: pipeline stages (the first mesh axis of [pp, dp, cp, tp]) [default: 1].
    #[arg(long, value_parser = parse::positive_usize)]
    pub pp: Option<usize>,
    /// GPT: sequence parallelism (the residual stream split along the sequence on the
    /// tensor-parallel axis between blocks).
    #[arg(long)]
    #[serde(default, skip_serializing_if = "std::ops::Not::not")]
    pub sp: bool,
    /// GPT: context-parallel degree: each sequence split over this many ranks in 2 x cp
    /// load-balanced causal chunks (rank i holds chunks i and 2cp-1-i) [default: 1]; pp x dp x
    /// cp x tp must equal the world size.
    #[arg(long, value_parser = parse::positive_usize)]
    pub cp: Option<usize>,
    /// GPT: expert-parallel degree: the experts of every mixture-of-experts block split over
    /// this many of the data-parallel ranks, tokens sent to their experts' ranks and back
    /// (must divide --dp and the expert count) [default: 1].
    #[arg(long, value_parser = parse::positive_usize)]
    pub ep: Option<usize>,
    /// GPT: attention over the context-parallel split: ring or alltoall [default: ring].
    #[arg(long, value_enum)]
    pub cp_attention: Option<CpAttentionArg>,
    /// GPT: pipeline micro-batches per step (the batch is split into this many) [default: 1].
    #[arg(long, value_parser = parse::positive_usize)]
    pub micro_batches: Option<usize>,
    /// GPT: pipeline schedule [default: 1f1b].
    #[arg(long, value_enum)]
    pub schedule: Option<ScheduleArg>,
    /// GPT: chunks of layers per pipeline stage (interleaved schedule) [default: 1].
    #[arg(long, value_parser = parse::positive_usize)]
    pub virtual_stages: Option<usize>,
    /// ZeRO stage over the data-parallel axis: 1 shards optimizer state, 2 also gradients,
    /// 3 also parameters (gathered at use) [default: 0].
    #[arg(long, value_parser = parse::zero_stage)]
    pub zero: Option<u8>,
    /// GPT: activation recomputation: none, full (every block), selective (attention) or
    /// gelu (the MLP's GELU output, from its kept pre-activation) [default: none].
    #[arg(long, value_enum)]
    pub recompute: Option<RecomputeArg>,
    /// Device of the mesh: auto (cuda when the world runs on NCCL, else cpu), cpu, or cuda
    /// (one GPU per rank; needs the NCCL backend) [default: auto].
    #[arg(long, value_enum)]
    pub device: Option<Dev>,
    /// The backend of the world: auto (the launch environment decides), cpu, or mpi
    /// [default: auto].
    #[arg(long, value_enum)]
    pub backend: Option<WorldBackend>,
    /// Precision policy: f32, f64, tf32 (f32 products on tensor cores, cuda only) or
    /// bf16-mixed (bf16 compute copies and activations over --dtype master weights) [default:
    /// bf16-mixed on cuda, everything in --dtype on cpu].
    #[arg(long, value_enum)]
    pub precision: Option<PrecisionPolicy>,
}

/// Where the data comes from.
#[derive(Args, Clone, Debug, Default, Serialize, Deserialize)]
#[serde(deny_unknown_fields, rename_all = "kebab-case")]
pub struct DataFlags {
    /// GPT: token shards (a path ending in .bin, or a glob: nanoGPT's raw u16 files or llm.c's,
    /// u16 or u32 ids), a text file (through --tokenizer), or a pre-tokenized file (`OXFTOK16`
    /// or `OXFTOK32`, u32 vocabulary size, u16 or u32 ids). Default: the texts under
    /// /usr/share/common-licenses, else generated text.
    #[arg(long)]
    pub data: Option<String>,
    /// GPT: held-out token shards (a path or glob) [default: the last 10% of --data].
    #[arg(long)]
    pub val_data: Option<String>,
    /// GPT: tokenizer of text data and samples: bytes, gpt2, or a Hugging Face tokenizer.json
    /// (its path, or a directory holding one) [default: bytes].
    #[arg(long)]
    pub tokenizer: Option<TokenizerArg>,
    /// GPT: the layout of token shards [default: auto].
    #[arg(long, value_enum)]
    pub shard_format: Option<ShardFormatArg>,
    /// Global batch per step (split over the data-parallel axis) [default: 16 windows (gpt),
    /// 64 samples (mlp)].
    #[arg(long, value_parser = parse::positive_usize)]
    pub batch_size: Option<usize>,
}

/// The optimizer and its schedule.
#[derive(Args, Clone, Debug, Default, Serialize, Deserialize)]
#[serde(deny_unknown_fields, rename_all = "kebab-case")]
pub struct OptimFlags {
    /// The optimizer [default: adamw (gpt, the only one), sgd (mlp)].
    #[arg(long, value_enum)]
    pub optimizer: Option<Opt>,
    /// Peak learning rate (finite, above 0) [default: 0.005 (gpt), 0.05 (mlp)].
    #[arg(long, value_parser = parse::positive_finite, allow_hyphen_values = true)]
    pub lr: Option<f64>,
    /// The learning rate after the warm-up [default: constant].
    #[arg(long, value_enum)]
    pub lr_schedule: Option<LrScheduleArg>,
    /// Steps of linear warm-up to --lr (at most --steps) [default: 0].
    #[arg(long, value_parser = parse::u64_any)]
    pub warmup_steps: Option<u64>,
    /// The learning rate cosine and linear schedules end at, in [0, --lr] [default: 0].
    #[arg(long, value_parser = parse::non_negative, allow_hyphen_values = true)]
    pub min_lr: Option<f64>,
    /// Weight decay of matrix weights (biases, norms and embeddings take none) [default: 0.01
    /// (adamw), 0 (sgd)].
    #[arg(long, value_parser = parse::non_negative, allow_hyphen_values = true)]
    pub weight_decay: Option<f64>,
    /// SGD momentum, in [0, 1) [default: 0.9].
    #[arg(long, value_parser = parse::unit_fraction, allow_hyphen_values = true)]
    pub momentum: Option<f64>,
    /// Clip the global L2 norm of all gradients to this (finite, above 0) [default: no
    /// clipping].
    #[arg(long, value_parser = parse::positive_finite, allow_hyphen_values = true)]
    pub clip_grad: Option<f64>,
    /// Gradient accumulation: each step runs its batch as this many parts (independent of
    /// pipeline micro-batches) [default: 1].
    #[arg(long, value_parser = parse::positive_usize)]
    pub grad_accum: Option<usize>,
    /// Data-parallel gradients are reduced during the backward pass in buckets of this many
    /// MiB (one collective per bucket, in the reverse order of use); 0: each gradient reduced
    /// on its own after the backward pass [default: 25].
    #[arg(long, value_parser = parse::non_negative, allow_hyphen_values = true)]
    pub bucket_mb: Option<f64>,
    /// The dtype gradient buckets move as (the policy's `reduce` field: bf16, f16, f32 or
    /// f64): each rank's part is converted (rounded once) and the collective sums in it; bf16
    /// halves the bytes of f32 gradients [default: the gradients' own dtype].
    #[arg(long, value_parser = parse::float_dtype)]
    pub reduce_dtype: Option<DType>,
}

/// The run: its length, logs, checkpoints and outputs.
#[derive(Args, Clone, Debug, Default, Serialize, Deserialize)]
#[serde(deny_unknown_fields, rename_all = "kebab-case")]
pub struct RunFlags {
    /// Train until this step (a resumed run continues from its checkpoint's step) [default:
    /// 400 (gpt), 200 (mlp)].
    #[arg(long, value_parser = parse::positive_u64)]
    pub steps: Option<u64>,
    /// Print a step line every this many steps [default: 10].
    #[arg(long, value_parser = parse::positive_u64)]
    pub log_every: Option<u64>,
    /// Also evaluate the held-out loss every this many steps.
    #[arg(long, value_parser = parse::positive_u64)]
    pub eval_every: Option<u64>,
    /// Save a checkpoint (directory) here at the end (and every --save-every steps). An
    /// existing path must be a checkpoint: anything else is refused, never replaced. `DIR/` (or
    /// a folder holding checkpoints or nothing): each save a new `DIR/step-NNNNNNNN`.
    #[arg(long)]
    pub save: Option<PathBuf>,
    /// Also save every this many steps (needs --save).
    #[arg(long, value_parser = parse::positive_u64)]
    pub save_every: Option<u64>,
    /// Rank 0 writes whole tensors instead of every rank its pieces (needs --save).
    #[arg(long)]
    #[serde(default, skip_serializing_if = "std::ops::Not::not")]
    pub save_gathered: bool,
    /// Resume from a checkpoint saved under any layout; continues its step count up to --steps.
    /// `auto`: the newest complete checkpoint at --save's path, or a fresh start when there is
    /// none (oflaunch --max-restarts); one that already reaches --steps means the job is done.
    #[arg(long)]
    pub resume: Option<PathBuf>,
    /// Resume even if the checkpoint's seed, optimizer, batch size, tokenizer or data differ
    /// from this run's.
    #[arg(long)]
    #[serde(default, skip_serializing_if = "std::ops::Not::not")]
    pub allow_resume_mismatch: bool,
    /// Write one JSON object per logged step (and per held-out evaluation) to this file.
    #[arg(long)]
    pub metrics: Option<PathBuf>,
    /// Render the training and held-out loss curves to this file (.svg or .png).
    #[arg(long)]
    pub plot: Option<PathBuf>,
    /// Replace an existing --metrics or --plot file of another run (a resumed run appends to
    /// its own metrics and redraws its own plot without this).
    #[arg(long)]
    #[serde(default, skip_serializing_if = "std::ops::Not::not")]
    pub overwrite: bool,
    /// Peak FLOP/s of one device in TFLOP/s, for the model FLOPs utilisation in --metrics.
    #[arg(long, value_parser = parse::positive_finite)]
    pub peak_tflops: Option<f64>,
    /// A step whose loss or gradient norm is NaN or infinite: stop (an error naming the step
    /// and the first non-finite tensor, before the update, so no checkpoint holds it) or skip
    /// its update [default: stop].
    #[arg(long, value_enum)]
    pub on_nonfinite: Option<NonFiniteArg>,
    /// Warn when the loss smoothed over about 10 steps exceeds this factor (above 1) times
    /// its lowest value so far [default: 4].
    #[arg(long, value_parser = parse::spike_factor, allow_hyphen_values = true)]
    pub loss_spike_factor: Option<f64>,
    /// Run one training step and print (rank 0) every parameter's global shape, placement and
    /// SBP, every op's output layout and each boxing inserted with its bytes; then exit.
    #[arg(long)]
    #[serde(default, skip_serializing_if = "std::ops::Not::not")]
    pub explain: bool,
    /// Compile each step's forward and backward passes: captured on the first step, replayed
    /// on later ones, compiled again (saying why) when the batch's shapes change; rank 0
    /// prints one line per compilation. Pipelined, each rank compiles its stage's run of the
    /// schedule. Not with dropout.
    #[arg(long)]
    #[serde(default, skip_serializing_if = "std::ops::Not::not")]
    pub compile: bool,
    /// Train nothing: print the mean next-token loss over every whole window of --seq-len + 1
    /// tokens of --data (non-overlapping; each window's first token is context only),
    /// --batch-size windows at a time, and its perplexity.
    #[arg(long)]
    #[serde(default, skip_serializing_if = "std::ops::Not::not")]
    pub eval_only: bool,
    /// Write the model, after training, as a Hugging Face directory here (config.json,
    /// safetensors shards and their index; the folder must not exist or be empty).
    #[arg(long)]
    pub save_hf: Option<PathBuf>,
    /// LoRA: --save-hf writes the base weights with the adapters merged in (W + (alpha/R) B A)
    /// under the Hugging Face names, instead of the adapters alone in PEFT's layout
    /// (adapter_model.safetensors, adapter_config.json).
    #[arg(long)]
    #[serde(default, skip_serializing_if = "std::ops::Not::not")]
    pub merge_lora: bool,
}

/// The GPT's generated sample.
#[derive(Args, Clone, Debug, Default, Serialize, Deserialize)]
#[serde(deny_unknown_fields, rename_all = "kebab-case")]
pub struct GenerateFlags {
    /// GPT: the prompt of the generated sample [default: "The "]. With --resume and no
    /// --steps: only generate.
    #[arg(long)]
    pub generate: Option<String>,
    /// GPT: tokens of the generated sample (0: none; at most 100000) [default: 120].
    #[arg(long, value_parser = parse::gen_tokens)]
    pub gen_tokens: Option<usize>,
    /// GPT: sampling temperature (0: greedy) [default: 0.8].
    #[arg(long, value_parser = parse::non_negative, allow_hyphen_values = true)]
    pub temperature: Option<f64>,
    /// GPT: prompts as token ids, `5,17,3`, several separated by `;`; each continuation is
    /// printed as `generated ids: a,b,c` (prompts of one length decode as one batch).
    #[arg(long)]
    pub prompt_ids: Option<String>,
    /// GPT: run the whole generation request this many times untimed before the timed one
    /// (the one-time device costs, such as attention plans and the decoding step's compile,
    /// paid before timing, as benchmarks' warm-ups do; at most 100) [default: 0].
    #[arg(long, value_parser = parse::gen_warmup)]
    pub gen_warmup: Option<usize>,
    /// GPT: sample only among the this many most likely ids (0: all) [default: 0].
    #[arg(long, value_parser = parse::usize_any)]
    pub top_k: Option<usize>,
    /// GPT: sample only among the fewest most likely ids holding this much of the
    /// probability, in (0, 1] [default: 1].
    #[arg(long, value_parser = parse::probability)]
    pub top_p: Option<f64>,
}

/// Every setting, by section (the job file's tables).
#[derive(Args, Clone, Debug, Default, Serialize, Deserialize)]
#[serde(deny_unknown_fields, rename_all = "kebab-case")]
pub struct Flags {
    #[command(flatten)]
    #[serde(default)]
    pub model: ModelFlags,
    #[command(flatten)]
    #[serde(default)]
    pub parallel: ParallelFlags,
    #[command(flatten)]
    #[serde(default)]
    pub data: DataFlags,
    #[command(flatten)]
    #[serde(default)]
    pub optim: OptimFlags,
    #[command(flatten)]
    #[serde(default)]
    pub run: RunFlags,
    #[command(flatten)]
    #[serde(default)]
    pub generate: GenerateFlags,
}
