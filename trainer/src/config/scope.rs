//! Which settings a job uses. Some keys belong to one model, optimizer, kind of data, schedule,
//! output or mode (a job that trains, one that only explains a step, one that only generates);
//! a key given (on the command line or in a job file) that the resolved job does not use is
//! refused by name, never silently ignored, and the printed configuration leaves such keys out
//! (so it stays a job file this check accepts).

use super::flags::{LrScheduleArg, ModelKind, Opt};
use super::{names_shards, reads_shards, TrainConfig};
use crate::error::TrainError;

/// What a key needs of the job to be used.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum Needs {
    /// A decoder (GPT or Llama).
    Gpt,
    /// A decoder whose architecture and sizes the flags give (no `--from-hf`).
    Built,
    /// A Llama built from the flags.
    Llama,
    /// No `--from-hf` (which names the architecture).
    NoHf,
    Mlp,
    Sgd,
    /// GPT data given as token shards.
    Shards,
    /// A GPT run through the pipeline runner.
    Pipeline,
    /// A cosine or linear learning-rate schedule.
    DecayingLr,
    Metrics,
    /// `--metrics` or `--plot`.
    Outputs,
    /// A GPT sample of at least one token (not under --explain).
    Sample,
    /// A GPT that generates a sample (not under --explain).
    Generates,
    /// A job that trains (every job but one that only generates or only evaluates).
    Trains,
    /// A job that reads batches of data (every job but one that only generates).
    Batches,
    /// A job that runs its training loop (not --explain, not one that only generates).
    Loop,
    /// Data-parallel gradient buckets (a GPT with --bucket-mb above 0).
    Buckets,
    /// Training steps (no `--eval-only`).
    Training,
    /// A decoder job that runs to its end (not `--explain`, which runs one step and exits).
    Runs,
    /// LoRA adapters (`--lora-rank`).
    Lora,
}

/// Every key only some jobs use (`section.key`), with what it needs.
const SCOPED: &[(&str, Needs)] = &[
    ("model.model", Needs::NoHf),
    ("model.layers", Needs::Built),
    ("model.heads", Needs::Built),
    ("model.width", Needs::Built),
    ("model.seq-len", Needs::Gpt),
    ("model.vocab-multiple", Needs::Gpt),
    ("model.dropout", Needs::Gpt),
    ("model.dropout", Needs::Trains),
    ("model.hidden", Needs::Mlp),
    ("model.features", Needs::Mlp),
    ("model.classes", Needs::Mlp),
    ("model.kv-heads", Needs::Llama),
    ("model.ffn-width", Needs::Llama),
    ("model.rope-theta", Needs::Llama),
    ("model.norm-eps", Needs::Llama),
    ("model.tie-embeddings", Needs::Llama),
    ("model.from-hf", Needs::Gpt),
    ("model.lora-rank", Needs::Gpt),
    ("model.lora-alpha", Needs::Lora),
    ("model.lora-targets", Needs::Lora),
    ("model.lora-dropout", Needs::Lora),
    ("run.merge-lora", Needs::Lora),
    ("run.merge-lora", Needs::Runs),
    ("parallel.pp", Needs::Gpt),
    ("parallel.sp", Needs::Gpt),
    ("parallel.cp", Needs::Gpt),
    ("parallel.ep", Needs::Gpt),
    ("parallel.cp-attention", Needs::Gpt),
    ("parallel.micro-batches", Needs::Gpt),
    ("parallel.virtual-stages", Needs::Gpt),
    ("parallel.zero", Needs::Gpt),
    ("parallel.recompute", Needs::Gpt),
    ("parallel.recompute", Needs::Trains),
    ("parallel.schedule", Needs::Pipeline),
    ("data.data", Needs::Gpt),
    ("data.tokenizer", Needs::Gpt),
    ("data.val-data", Needs::Shards),
    ("data.val-data", Needs::Loop),
    ("data.shard-format", Needs::Shards),
    ("data.batch-size", Needs::Batches),
    ("optim.momentum", Needs::Sgd),
    ("optim.min-lr", Needs::DecayingLr),
    ("optim.reduce-dtype", Needs::Buckets),
    ("optim.lr", Needs::Trains),
    ("optim.lr-schedule", Needs::Trains),
    ("optim.warmup-steps", Needs::Trains),
    ("optim.min-lr", Needs::Trains),
    ("optim.weight-decay", Needs::Trains),
    ("optim.momentum", Needs::Trains),
    ("optim.clip-grad", Needs::Trains),
    ("optim.grad-accum", Needs::Trains),
    ("optim.bucket-mb", Needs::Trains),
    ("optim.reduce-dtype", Needs::Trains),
    ("run.on-nonfinite", Needs::Trains),
    ("run.loss-spike-factor", Needs::Trains),
    ("run.compile", Needs::Trains),
    ("run.log-every", Needs::Loop),
    ("run.eval-every", Needs::Loop),
    ("run.save", Needs::Loop),
    ("run.save-every", Needs::Loop),
    ("run.save-gathered", Needs::Loop),
    ("run.metrics", Needs::Loop),
    ("run.plot", Needs::Loop),
    ("run.peak-tflops", Needs::Metrics),
    ("run.peak-tflops", Needs::Loop),
    ("run.overwrite", Needs::Outputs),
    ("run.overwrite", Needs::Loop),
    ("generate.gen-tokens", Needs::Generates),
    ("run.steps", Needs::Training),
    ("run.eval-every", Needs::Training),
    ("run.save", Needs::Training),
    ("run.save-every", Needs::Training),
    ("run.metrics", Needs::Training),
    ("run.plot", Needs::Training),
    ("run.eval-only", Needs::Gpt),
    ("run.save-hf", Needs::Gpt),
    ("run.save-hf", Needs::Runs),
    ("generate.gen-tokens", Needs::Gpt),
    ("generate.generate", Needs::Sample),
    ("generate.gen-warmup", Needs::Sample),
    ("generate.temperature", Needs::Sample),
    ("generate.prompt-ids", Needs::Sample),
    ("generate.top-k", Needs::Sample),
    ("generate.top-p", Needs::Sample),
];

impl Needs {
    fn met(self, c: &TrainConfig) -> bool {
        let gpt = c.decoder();
        let hf = c.model.from_hf.is_some();
        match self {
            Needs::Gpt => gpt,
            Needs::Built => gpt && !hf,
            Needs::Llama => c.model.model == ModelKind::Llama && !hf,
            Needs::NoHf => !hf,
            Needs::Mlp => c.model.model == ModelKind::Mlp,
            Needs::Sgd => c.optim.optimizer == Opt::Sgd,
            Needs::Shards => {
                gpt && c
                    .data
                    .data
                    .as_deref()
                    .is_some_and(|d| reads_shards(d).unwrap_or_else(|_| names_shards(d)))
            }
            Needs::Pipeline => gpt && c.pipelined(),
            Needs::DecayingLr => c.optim.lr_schedule != LrScheduleArg::Constant,
            Needs::Metrics => c.run.metrics.is_some(),
            Needs::Outputs => c.run.metrics.is_some() || c.run.plot.is_some(),
            Needs::Sample => gpt && c.generate.gen_tokens > 0 && !c.run.explain,
            Needs::Generates => gpt && !c.run.explain,
            Needs::Trains => !c.generates_only() && !c.run.eval_only,
            Needs::Batches => !c.generates_only(),
            Needs::Loop => !c.generates_only() && !c.run.explain,
            Needs::Buckets => gpt && c.optim.bucket_mb > 0.0,
            Needs::Training => !c.run.eval_only,
            Needs::Runs => !c.run.explain,
            Needs::Lora => gpt && c.model.lora_rank.is_some(),
        }
    }

    /// Why a job that does not meet this need has no use for the keys.
    fn why(self, c: &TrainConfig) -> &'static str {
        let hf = c.model.from_hf.is_some();
        match (self, c.model.model) {
            (Needs::Mlp, _) => "settings of --model mlp, and this job trains a decoder",
            (Needs::Built | Needs::Llama | Needs::NoHf, _) if hf => {
                "the architecture and its sizes, which come from --from-hf's config.json"
            }
            (Needs::Llama, ModelKind::Gpt) => {
                "settings of --model llama, and this job trains --model gpt"
            }
            (Needs::Training, _) => "settings of training, and --eval-only trains nothing",
            (Needs::Runs, _) => "settings of a whole run, and --explain runs one step and exits",
            (
                Needs::Gpt
                | Needs::Built
                | Needs::Llama
                | Needs::NoHf
                | Needs::Shards
                | Needs::Pipeline
                | Needs::Sample
                | Needs::Generates
                | Needs::Buckets,
                ModelKind::Mlp,
            ) => "settings of --model gpt, and this job trains --model mlp",
            (Needs::Sample | Needs::Generates | Needs::Loop, _) if c.run.explain => {
                "settings of the training loop and the sample, and --explain runs one step and \
                 exits"
            }
            (Needs::Trains | Needs::Loop, _) if c.run.eval_only => {
                "settings of training, and --eval-only trains nothing"
            }
            (Needs::Trains | Needs::Loop | Needs::Batches, _) => {
                "settings of training, and this job only generates (a prompt with --resume or \
                 --from-hf, and no --steps)"
            }
            (Needs::Sgd, _) => "settings of SGD, and this job trains with AdamW",
            (Needs::Shards, _) => {
                "settings of token shards, and --data names none (a text or pre-tokenized file \
                 is read whole)"
            }
            (Needs::Pipeline, _) => {
                "settings of pipeline micro-batches, and this job has none (--pp 1, \
                 --micro-batches 1, --virtual-stages 1)"
            }
            (Needs::DecayingLr, _) => {
                "where cosine and linear schedules end, and --lr-schedule is constant"
            }
            (Needs::Metrics, _) => "settings of --metrics records, and --metrics is not given",
            (Needs::Outputs, _) => "settings of --metrics and --plot files, and neither is given",
            (Needs::Sample, _) => "settings of the generated sample, and --gen-tokens is 0",
            (Needs::Buckets, _) => "settings of gradient buckets, and --bucket-mb is 0",
            (Needs::Gpt | Needs::Built | Needs::Llama | Needs::NoHf, _) => {
                "settings of a decoder (--model gpt or llama)"
            }
            (Needs::Generates, _) => {
                "settings of the generated sample, and --explain runs one step and exits"
            }
            (Needs::Lora, _) => "settings of LoRA adapters, and --lora-rank is not given",
        }
    }
}

/// The `--flag` a `section.key` is.
fn flag_of(key: &str) -> String {
    format!("--{}", key.split_once('.').map_or(key, |(_, k)| k))
}

/// Refuses the keys the user gave that `c` does not use, naming each with why.
pub(super) fn refuse_unused(c: &TrainConfig) -> Result<(), TrainError> {
    // (why, the flags it covers), in the order of `SCOPED`.
    let mut unused: Vec<(&str, Vec<String>)> = Vec::new();
    let mut seen: Vec<&str> = Vec::new();
    for (key, needs) in SCOPED {
        if !c.is_set(key) || needs.met(c) || seen.contains(key) {
            continue;
        }
        seen.push(key);
        let why = needs.why(c);
        let flag = format!("{} ({key})", flag_of(key));
        match unused.iter_mut().find(|(w, _)| *w == why) {
            Some((_, flags)) => flags.push(flag),
            None => unused.push((why, vec![flag])),
        }
    }
    if unused.is_empty() {
        return Ok(());
    }
    let parts: Vec<String> = unused
        .iter()
        .map(|(why, flags)| format!("{}: {why}", flags.join(", ")))
        .collect();
    Err(TrainError::Config {
        detail: format!(
            "given but not used by this job (refused rather than ignored; drop them): {}",
            parts.join("; ")
        ),
    })
}

/// Removes from the printed configuration `table` the keys `c` does not use.
pub(super) fn drop_unused(c: &TrainConfig, table: &mut toml::Table) {
    for (key, needs) in SCOPED {
        if needs.met(c) {
            continue;
        }
        if let Some((section, name)) = key.split_once('.') {
            if let Some(toml::Value::Table(t)) = table.get_mut(section) {
                t.remove(name);
            }
        }
    }
}
