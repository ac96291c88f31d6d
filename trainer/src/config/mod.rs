//! The configuration of a training job: `Flags` as written (command line, job file), merged
//! (`load`: the job file's tables, then the command line over them; unknown keys refused by
//! name) and resolved into `TrainConfig`, every value checked and every default filled in,
//! before any tensor exists. `TrainConfig` prints as a job file (`to_toml`) with the same keys.

mod checks;
mod flags;
#[cfg(test)]
mod precision_tests;
mod resolve;
mod scope;
mod tokenizer;

use std::collections::BTreeSet;
use std::path::{Path, PathBuf};

use oxiflow_dtype::{DType, MixedPrecision};
use oxiflow_models::data::{identify_file, TokenHeader};
use oxiflow_models::pipeline::{PipelineSpec, Schedule};
use oxiflow_placement::DeviceType;
use serde::Serialize;

pub use checks::{parse, MAX_GEN_TOKENS};
pub use flags::{
    CpAttentionArg, DataFlags, Dev, Flags, GenerateFlags, LrScheduleArg, ModelFlags, ModelKind,
    NonFiniteArg, Opt, OptimFlags, ParallelFlags, PrecisionPolicy, RecomputeArg, RunFlags,
    ScheduleArg, ShardFormatArg, WorldBackend,
};
pub use tokenizer::TokenizerArg;

use crate::error::TrainError;
use crate::schedule::{Decay, LrSchedule};

/// The model and its sizes.
#[derive(Clone, Debug, PartialEq, Serialize)]
#[serde(rename_all = "kebab-case")]
pub struct ModelConfig {
    pub model: ModelKind,
    pub layers: usize,
    pub heads: usize,
    pub width: usize,
    pub seq_len: usize,
    /// The token table's rows are the vocabulary rounded up to a multiple of this.
    pub vocab_multiple: usize,
    pub dropout: f64,
    pub hidden: usize,
    pub features: usize,
    pub classes: usize,
    /// The master weights' and the data's dtype (the precision policy's `param`).
    pub dtype: DType,
    pub seed: u64,
    /// Llama: key/value heads (None: as many as query heads).
    pub kv_heads: Option<usize>,
    /// Llama: the MLP's width (None: 4 x width).
    pub ffn_width: Option<usize>,
    pub rope_theta: f64,
    pub norm_eps: f64,
    pub tie_embeddings: bool,
    /// A Hugging Face model directory: the architecture, sizes and weights.
    pub from_hf: Option<PathBuf>,
    /// LoRA fine-tuning: the adapters' rank (None: a full fine-tune).
    pub lora_rank: Option<usize>,
    pub lora_alpha: f64,
    /// The adapted layers as given (None: the architecture's default).
    pub lora_targets: Option<String>,
    /// Dropout on the adapters' input: 0 (nothing else is accepted).
    pub lora_dropout: f64,
}

/// The layout on the ranks (`dp` None: the world size over pp x tp).
#[derive(Clone, Debug, PartialEq, Serialize)]
#[serde(rename_all = "kebab-case")]
pub struct ParallelConfig {
    pub dp: Option<usize>,
    pub tp: usize,
    pub pp: usize,
    pub sp: bool,
    pub cp: usize,
    /// Expert-parallel ranks, drawn from the data-parallel ones (`dp` counts them).
    pub ep: usize,
    pub cp_attention: CpAttentionArg,
    pub micro_batches: usize,
    pub schedule: ScheduleArg,
    pub virtual_stages: usize,
    pub zero: u8,
    pub recompute: RecomputeArg,
    pub device: Dev,
    pub backend: WorldBackend,
    /// None: by device (bf16-mixed on cuda, everything in `model.dtype` on cpu).
    pub precision: Option<PrecisionPolicy>,
}

impl ParallelConfig {
    /// The pipeline the flags ask for: `--schedule` over `--pp` stages of `--micro-batches`
    /// and `--virtual-stages` (unchecked: `PipelineSpec::validate`).
    pub fn pipeline_spec(&self) -> PipelineSpec {
        PipelineSpec {
            schedule: match self.schedule {
                ScheduleArg::Gpipe => Schedule::GPipe,
                ScheduleArg::OneFOneB => Schedule::OneFOneB,
                ScheduleArg::Interleaved => Schedule::Interleaved,
            },
            stages: self.pp,
            micro_batches: self.micro_batches,
            virtual_stages: self.virtual_stages,
        }
    }
}

/// The data.
#[derive(Clone, Debug, PartialEq, Serialize)]
#[serde(rename_all = "kebab-case")]
pub struct DataConfig {
    pub data: Option<String>,
    pub val_data: Option<String>,
    pub tokenizer: TokenizerArg,
    pub shard_format: ShardFormatArg,
    pub batch_size: usize,
}

/// The optimizer and its schedule.
#[derive(Clone, Debug, PartialEq, Serialize)]
#[serde(rename_all = "kebab-case")]
pub struct OptimConfig {
    pub optimizer: Opt,
    pub lr: f64,
    pub lr_schedule: LrScheduleArg,
    pub warmup_steps: u64,
    pub min_lr: f64,
    pub weight_decay: f64,
    pub momentum: f64,
    pub clip_grad: Option<f64>,
    pub grad_accum: usize,
    /// MiB per data-parallel gradient bucket (0: no buckets).
    pub bucket_mb: f64,
    /// The dtype gradient buckets move as (None: the gradients' own).
    pub reduce_dtype: Option<DType>,
}

impl OptimConfig {
    /// Bytes per data-parallel gradient bucket (0: no buckets).
    pub fn bucket_bytes(&self) -> usize {
        (self.bucket_mb * 1024.0 * 1024.0).ceil() as usize
    }
}

/// The run's length, logs, checkpoints and outputs.
#[derive(Clone, Debug, PartialEq, Serialize)]
#[serde(rename_all = "kebab-case")]
pub struct RunConfig {
    pub steps: u64,
    pub log_every: u64,
    pub eval_every: Option<u64>,
    pub save: Option<PathBuf>,
    pub save_every: Option<u64>,
    pub save_gathered: bool,
    pub resume: Option<PathBuf>,
    pub allow_resume_mismatch: bool,
    pub metrics: Option<PathBuf>,
    pub plot: Option<PathBuf>,
    pub overwrite: bool,
    pub peak_tflops: Option<f64>,
    pub on_nonfinite: NonFiniteArg,
    pub loss_spike_factor: f64,
    pub explain: bool,
    pub compile: bool,
    pub eval_only: bool,
    pub save_hf: Option<PathBuf>,
    /// LoRA: --save-hf merges the adapters into the weights.
    pub merge_lora: bool,
}

/// The GPT's sample.
#[derive(Clone, Debug, PartialEq, Serialize)]
#[serde(rename_all = "kebab-case")]
pub struct GenerateConfig {
    pub generate: Option<String>,
    pub gen_tokens: usize,
    /// Untimed runs of the request before the timed one.
    pub gen_warmup: usize,
    pub temperature: f64,
    /// Prompts as token ids, as given (`checks::prompt_ids` parses them).
    pub prompt_ids: Option<String>,
    /// 0: every id.
    pub top_k: usize,
    pub top_p: f64,
}

impl GenerateConfig {
    /// The prompts `--prompt-ids` gives (checked when the configuration resolved).
    pub fn prompts(&self) -> Vec<Vec<usize>> {
        self.prompt_ids
            .as_deref()
            .and_then(|p| checks::prompt_ids(p).ok())
            .unwrap_or_default()
    }
}

/// A checked training job.
#[derive(Clone, Debug, PartialEq, Serialize)]
#[serde(rename_all = "kebab-case")]
pub struct TrainConfig {
    pub model: ModelConfig,
    pub parallel: ParallelConfig,
    pub data: DataConfig,
    pub optim: OptimConfig,
    pub run: RunConfig,
    pub generate: GenerateConfig,
    /// The keys given (`section.key`, from the job file or the command line), not defaulted.
    #[serde(skip)]
    pub explicit: BTreeSet<String>,
    /// The job file the configuration was read from (`--config`), an input of the run.
    #[serde(skip)]
    pub job_file: Option<PathBuf>,
}

impl TrainConfig {
    /// The precision policy on `device`, the one place `--precision`, `--dtype` and
    /// `--reduce-dtype` become a value: the flag's policy (by default bf16-mixed on cuda and
    /// everything in `--dtype` on cpu) over `--dtype` master weights, gradients moving as
    /// `--reduce-dtype` (default: the master weights' dtype). A combination the value refuses
    /// is a configuration error naming it (`resolve` already tried both devices).
    pub fn precision(&self, device: DeviceType) -> Result<MixedPrecision, TrainError> {
        let param = self.model.dtype;
        let policy = self.parallel.precision.unwrap_or(match device {
            DeviceType::Cuda => PrecisionPolicy::Bf16Mixed,
            DeviceType::Cpu => PrecisionPolicy::F32,
        });
        let policy = policy.with_param(param);
        let policy = match self.optim.reduce_dtype {
            Some(r) => policy.and_then(|p| p.with_reduce(r)),
            None => policy,
        };
        policy.map_err(|e| TrainError::Config {
            detail: format!(
                "--precision {} --dtype {param}{}: {e}",
                self.parallel
                    .precision
                    .map_or("(default)", PrecisionPolicy::as_str),
                self.optim
                    .reduce_dtype
                    .map_or(String::new(), |r| format!(" --reduce-dtype {r}")),
            ),
        })
    }

    /// `flags` checked and completed with the defaults (of the chosen model).
    pub fn resolve(flags: Flags, explicit: BTreeSet<String>) -> Result<TrainConfig, TrainError> {
        resolve::resolve(flags, explicit)
    }

    /// Whether `key` (`section.key`, e.g. `run.steps`) was given rather than defaulted.
    pub fn is_set(&self, key: &str) -> bool {
        self.explicit.contains(key)
    }

    /// The configuration as a job file: every key this job uses, defaults included (keys of
    /// the other model, optimizer or data kind are left out, as a job file may not give them).
    pub fn to_toml(&self) -> Result<String, TrainError> {
        let err = |e: &dyn std::fmt::Display| TrainError::Config {
            detail: format!("the configuration does not print as TOML: {e}"),
        };
        let mut table = toml::Table::try_from(self).map_err(|e| err(&e))?;
        scope::drop_unused(self, &mut table);
        toml::to_string(&table).map_err(|e| err(&e))
    }

    /// Whether the job trains a decoder (GPT or Llama, from flags or `--from-hf`).
    pub fn decoder(&self) -> bool {
        self.model.model.is_decoder()
    }

    /// Whether a decoder job only generates: a prompt (`--generate`, `--prompt-ids`) for a
    /// model from `--resume` or `--from-hf`, and no `--steps` (nor `--eval-only`).
    pub fn generates_only(&self) -> bool {
        let g = &self.generate;
        self.decoder()
            && (g.generate.is_some() || g.prompt_ids.is_some())
            && (self.run.resume.is_some() || self.model.from_hf.is_some())
            && !self.is_set("run.steps")
            && !self.run.eval_only
    }

    /// The learning-rate schedule the optimizer flags describe.
    pub fn lr_schedule(&self) -> LrSchedule {
        let o = &self.optim;
        LrSchedule {
            lr: o.lr,
            min_lr: o.min_lr,
            warmup: o.warmup_steps,
            steps: self.run.steps,
            decay: match o.lr_schedule {
                LrScheduleArg::Constant => Decay::Constant,
                LrScheduleArg::Cosine => Decay::Cosine,
                LrScheduleArg::Linear => Decay::Linear,
            },
        }
    }

    /// The prompt of the decoder's sample (`--generate`, else "The ").
    pub fn prompt(&self) -> &str {
        self.generate.generate.as_deref().unwrap_or("The ")
    }

    /// The step a resumed checkpoint must be below (none when only generating or evaluating).
    pub fn resume_limit(&self) -> Option<u64> {
        (!self.generates_only() && !self.run.eval_only).then_some(self.run.steps)
    }

    /// Whether GPT steps run through the pipeline runner (stages, micro-batches or chunks).
    pub fn pipelined(&self) -> bool {
        let p = &self.parallel;
        p.pp > 1 || p.micro_batches > 1 || p.virtual_stages > 1
    }
}

/// Whether `--data` names token shards: a glob, or a path ending in `.bin`.
pub fn names_shards(data: &str) -> bool {
    data.contains(['*', '?', '[']) || data.ends_with(".bin")
}

/// Whether `--data` is read as token shards, by the file's header where it names one file: a
/// glob; an llm.c header; a `.bin` without a known header (nanoGPT's raw ids). A pre-tokenized
/// file (`OXFTOK16`, `OXFTOK32`) is read whole whatever its name; a damaged header is an error naming it
/// (a `.bin`'s, as the shard reader of `--shard-format` names it).
pub fn reads_shards(data: &str) -> Result<bool, TrainError> {
    if data.contains(['*', '?', '[']) {
        return Ok(true);
    }
    let bin = data.ends_with(".bin");
    Ok(match identify_file(Path::new(data)) {
        Ok(TokenHeader::Llmc(_)) => true,
        Ok(TokenHeader::Pretokenized(_)) => false,
        Ok(TokenHeader::None) => bin,
        Err(_) if bin => true,
        Err(e) => return Err(e.into()),
    })
}

/// The job `cli` describes over the job file `config` (when given): the file's keys, then the
/// command line's over them, resolved.
pub fn load(config: Option<&Path>, cli: &Flags) -> Result<TrainConfig, TrainError> {
    let table = |flags: &Flags| -> Result<toml::Table, TrainError> {
        toml::Table::try_from(flags).map_err(|e| TrainError::Config {
            detail: format!("the command line does not form a configuration: {e}"),
        })
    };
    let mut merged = match config {
        Some(path) => read_job_file(path)?,
        None => toml::Table::new(),
    };
    for (section, values) in table(cli)? {
        match (merged.get_mut(&section), values) {
            (Some(toml::Value::Table(into)), toml::Value::Table(values)) => into.extend(values),
            (_, values) => {
                merged.insert(section, values);
            }
        }
    }
    let mut explicit = BTreeSet::new();
    for (section, values) in &merged {
        if let toml::Value::Table(t) = values {
            explicit.extend(t.keys().map(|k| format!("{section}.{k}")));
        }
    }
    architecture_of_resumed(&mut merged)?;
    let flags: Flags = merged
        .try_into()
        .map_err(|e: toml::de::Error| TrainError::Config {
            detail: format!("the merged configuration: {}", e.message()),
        })?;
    let mut cfg = TrainConfig::resolve(flags, explicit)?;
    cfg.job_file = config.map(Path::to_path_buf);
    Ok(cfg)
}

/// `--resume auto`: the newest complete checkpoint at `--save`'s path.
pub const RESUME_AUTO: &str = "auto";

/// Where the configuration of the checkpoint at `path` is written (beside it).
pub fn config_path(path: &Path) -> PathBuf {
    let mut p = path.as_os_str().to_owned();
    p.push(".config.toml");
    PathBuf::from(p)
}

/// The keys of a checkpoint's configuration that say what model it holds: a run resuming it
/// takes each one it does not give itself, so `--resume CKPT --generate ...` needs no sizes.
const ARCHITECTURE_KEYS: [(&str, &str); 20] = [
    ("model", "model"),
    ("model", "layers"),
    ("model", "heads"),
    ("model", "width"),
    ("model", "seq-len"),
    ("model", "vocab-multiple"),
    ("model", "hidden"),
    ("model", "features"),
    ("model", "classes"),
    ("model", "dtype"),
    ("model", "kv-heads"),
    ("model", "ffn-width"),
    ("model", "rope-theta"),
    ("model", "norm-eps"),
    ("model", "tie-embeddings"),
    ("model", "from-hf"),
    ("model", "lora-rank"),
    ("model", "lora-alpha"),
    ("model", "lora-targets"),
    ("data", "tokenizer"),
];

/// With `--resume PATH` (not `auto`, whose checkpoints are this job's own), the architecture
/// keys of the configuration saved beside the checkpoint that `merged` lacks, added as defaults
/// (not counted as given). A checkpoint without one keeps the flags as they are; its recorded
/// sizes still refuse a run that differs.
fn architecture_of_resumed(merged: &mut toml::Table) -> Result<(), TrainError> {
    let resume = merged
        .get("run")
        .and_then(|r| r.get("resume"))
        .and_then(toml::Value::as_str)
        .map(PathBuf::from);
    let Some(ckpt) = resume.filter(|p| p.as_os_str() != RESUME_AUTO) else {
        return Ok(());
    };
    let saved_path = config_path(&ckpt);
    if !saved_path.is_file() {
        return Ok(());
    }
    let what = format!(
        "--resume {}: its configuration {}",
        ckpt.display(),
        saved_path.display()
    );
    let saved = read_flags_file(&saved_path, &what)?;
    for (section, key) in ARCHITECTURE_KEYS {
        let Some(value) = saved.get(section).and_then(|t| t.get(key)) else {
            continue;
        };
        let into = merged
            .entry(section)
            .or_insert_with(|| toml::Value::Table(toml::Table::new()));
        if let toml::Value::Table(t) = into {
            t.entry(key).or_insert_with(|| value.clone());
        }
    }
    Ok(())
}

/// A job file's tables, checked against `Flags` (an unknown table or key is an error naming it).
fn read_job_file(path: &Path) -> Result<toml::Table, TrainError> {
    read_flags_file(path, &format!("--config {}", path.display()))
}

/// The tables of a file of flags (at most 1 MiB, every key one `Flags` knows); errors begin
/// with `what`, which names the file as the user gave it.
fn read_flags_file(path: &Path, what: &str) -> Result<toml::Table, TrainError> {
    let bad = |detail: String| TrainError::Config {
        detail: format!("{what}: {detail}"),
    };
    let meta = std::fs::metadata(path).map_err(|e| bad(e.to_string()))?;
    if !meta.is_file() || meta.len() > 1 << 20 {
        return Err(bad("not a regular file of at most 1 MiB".into()));
    }
    let text = std::fs::read_to_string(path).map_err(|e| bad(e.to_string()))?;
    let table: toml::Table = text
        .parse()
        .map_err(|e: toml::de::Error| bad(e.to_string()))?;
    // Deserializing into Flags names the first unknown key (and its line) or a wrong type.
    Flags::deserialize_table(&text).map_err(bad)?;
    Ok(table)
}

impl Flags {
    fn deserialize_table(text: &str) -> Result<Flags, String> {
        toml::from_str::<Flags>(text).map_err(|e| e.to_string())
    }
}
