//! The decoder task (GPT, Llama, or a Hugging Face model): `Gpt` as a `TrainModel` (decay on
//! matrix weights only; embeddings, biases and norms take none), its data (`GptInputs`: corpus
//! or token shards through the chosen tokenizer, or every window of them for an evaluation),
//! `gpt_trainer`, which builds the model on the job's stages with its optimizer and data, and
//! the prompts of its samples.

use std::sync::Arc;

use oxiflow_models::data::{
    Corpus, EvalWindows, ShardFormat, ShardSet, ShardWindows, StreamOrigin, Tokenizer, Windows,
    HELDOUT_FRACTION,
};
use oxiflow_models::nn::gpt::{padded_vocab, Gpt, MlpKind, MoeArch};
use oxiflow_models::nn::{Module, Parameter, Pass};
use oxiflow_models::optim::{AdamW, AdamWOptions, Zero};
use oxiflow_models::pipeline::{PipelineModel, PipelineSpec};
use oxiflow_placement::{AxisRole, DeviceType, MeshLayout};
use oxiflow_tensor::{Context, Tensor};

use crate::config::{reads_shards, RecomputeArg, ShardFormatArg, TrainConfig};
use crate::error::TrainError;
use crate::model::{Batch, TrainModel};
use crate::tasks::decoder::{build_decoder, stages_of, DecoderSpec};
use crate::tasks::gpt_data::{corpus_windows, GptData, RowSplit};
use crate::trainer::{PipelineRun, TrainOptions, Trainer};

impl TrainModel for Gpt {
    fn loss(&self, batch: &Batch, pass: Pass) -> Result<Tensor, TrainError> {
        Ok(Gpt::loss(self, &batch.inputs, &batch.targets, pass)?)
    }
    fn pipeline(&self) -> Option<&dyn PipelineModel> {
        Some(self)
    }
    fn decays(&self, p: &Parameter) -> bool {
        let embedding = p.name() == self.wte.weight.name()
            || self
                .wpe
                .as_ref()
                .is_some_and(|w| w.weight.name() == p.name());
        // Matrices, and the experts' stacked matrices.
        p.value().ndim() >= 2 && !embedding
    }
    fn flops_per_token(&self) -> Option<f64> {
        // nanoGPT's estimate: 6 N + 12 L C T, N without the position table.
        let positions = self.wpe.as_ref().map(|w| w.weight.name().to_string());
        let n: usize = self
            .parameters()
            .iter()
            .filter(|p| Some(p.name()) != positions.as_deref())
            .map(|p| p.value().numel())
            .sum();
        let c = &self.cfg;
        Some(6.0 * n as f64 + 12.0 * (c.layers * c.width * c.seq_len) as f64)
    }
}

fn layout_err(detail: String) -> TrainError {
    TrainError::Layout { detail }
}

/// Refuses, before the world starts, what a mixture of experts does not support: full
/// recomputation (the routing statistics of a recomputed block would carry no gradient), an
/// expert-parallel degree that does not divide the experts; and `--ep` on a dense model.
fn check_moe(cfg: &TrainConfig, moe: Option<&MoeArch>) -> Result<(), TrainError> {
    let ep = cfg.parallel.ep;
    let Some(moe) = moe else {
        if ep > 1 {
            return Err(TrainError::Config {
                detail: format!(
                    "--ep {ep} splits the experts of a mixture of experts; this model's MLPs \
                     are dense"
                ),
            });
        }
        return Ok(());
    };
    if !moe.experts.is_multiple_of(ep) {
        return Err(TrainError::Config {
            detail: format!(
                "--ep {ep} must divide the {} experts of each mixture-of-experts block (every \
                 expert-parallel rank holds as many)",
                moe.experts
            ),
        });
    }
    if cfg.parallel.recompute == RecomputeArg::Full {
        return Err(TrainError::Config {
            detail: "--recompute full: a mixture-of-experts block's routing statistics would \
                     carry no gradient; use --recompute selective"
                .into(),
        });
    }
    Ok(())
}

/// The decoder's data, opened and checked (every shard's header, size and ids) before the
/// world starts, so every rank refuses bad data alike without communicating; and the decoder
/// it feeds (a Hugging Face directory's configuration and weights' headers read).
pub struct GptInputs {
    /// The training and held-out windows (None under `--eval-only`, or for a Hugging Face
    /// model only generating).
    pub windows: Option<(Windows, Windows)>,
    /// Every window of the data, under `--eval-only`.
    pub eval: Option<EvalWindows>,
    pub vocab: usize,
    /// The token table's rows: `vocab` rounded up to a multiple of `--vocab-multiple`.
    pub table_rows: usize,
    pub description: String,
    /// The unigram entropy of the training text (corpus data).
    pub entropy: Option<f64>,
    pub tokenizer: Tokenizer,
    pub spec: DecoderSpec,
}

impl GptInputs {
    /// `cfg`'s data through its tokenizer, and its decoder.
    pub fn open(cfg: &TrainConfig) -> Result<GptInputs, TrainError> {
        let tokenizer = cfg.data.tokenizer.open()?;
        let hf = DecoderSpec::open_hf(cfg)?;
        let limit = hf.as_ref().map(|h| h.config.vocab);
        let (windows, eval, data_vocab, description, entropy) = if cfg.generates_only()
            && hf.is_some()
        {
            // A Hugging Face model only generating reads no data.
            let none = "none (generation only)".to_string();
            (None, None, tokenizer.vocab(), none, None)
        } else if cfg.run.eval_only {
            let (eval, vocab, description) = eval_windows(cfg, &tokenizer, limit)?;
            (None, Some(eval), vocab, description, None)
        } else {
            let (train, heldout, vocab, description, entropy) = windows(cfg, &tokenizer, limit)?;
            (Some((train, heldout)), None, vocab, description, entropy)
        };
        let vocab = limit.unwrap_or(data_vocab);
        let multiple = cfg.model.vocab_multiple;
        let table_rows = padded_vocab(vocab, multiple).ok_or_else(|| TrainError::Config {
            detail: format!(
                "--vocab-multiple {multiple}: the vocabulary {vocab} rounded up to it overflows"
            ),
        })?;
        let eos = tokenizer.end_of_text().map(|e| e as usize);
        let spec = DecoderSpec::resolve(cfg, vocab, eos, hf);
        spec.check()?;
        if let Some(ck) = spec.hf.as_ref().filter(|_| cfg.generate.gen_tokens > 0) {
            let text = match cfg.generate.generate.as_deref() {
                Some(t) => tokenizer.encode(t)?.len(),
                None => 0,
            };
            let longest = cfg
                .generate
                .prompts()
                .iter()
                .map(Vec::len)
                .max()
                .unwrap_or(0);
            ck.config
                .check_sliding_window(text.max(longest) + cfg.generate.gen_tokens)?;
        }
        check_moe(cfg, spec.arch.moe.as_ref())?;
        if spec.arch.mlp == MlpKind::SwiGlu && cfg.parallel.recompute == RecomputeArg::Gelu {
            return Err(TrainError::Config {
                detail: "--recompute gelu: this model's MLP is SwiGLU, with no GELU output to \
                         recompute"
                    .into(),
            });
        }
        Ok(GptInputs {
            windows,
            eval,
            vocab,
            table_rows,
            description,
            entropy,
            tokenizer,
            spec,
        })
    }
}

/// Refuses a tokenizer of `vocab` ids for a model of `limit` (a Hugging Face model's).
fn fits(vocab: usize, limit: Option<usize>, what: &str) -> Result<(), TrainError> {
    match limit {
        Some(l) if vocab > l => Err(TrainError::Config {
            detail: format!(
                "{what}: ids up to {vocab} do not fit the --from-hf model's vocabulary of {l}"
            ),
        }),
        _ => Ok(()),
    }
}

/// The shard format `cfg` names.
fn shard_format(cfg: &TrainConfig) -> ShardFormat {
    match cfg.data.shard_format {
        ShardFormatArg::Auto => ShardFormat::Auto,
        ShardFormatArg::Raw => ShardFormat::Raw,
        ShardFormatArg::Llmc => ShardFormat::Llmc,
    }
}

/// Every window of `--seq-len` + 1 tokens of `cfg`'s data (shards: ids checked against
/// `limit`, else the tokenizer's vocabulary), the vocabulary and a description.
fn eval_windows(
    cfg: &TrainConfig,
    tokenizer: &Tokenizer,
    limit: Option<usize>,
) -> Result<(EvalWindows, usize, String), TrainError> {
    let t = cfg.model.seq_len;
    match cfg.data.data.as_deref() {
        Some(pattern) if reads_shards(pattern)? => {
            let vocab = limit.unwrap_or_else(|| tokenizer.vocab());
            let set = Arc::new(ShardSet::open(pattern, shard_format(cfg), vocab)?);
            let description = format!(
                "{} {} shards {pattern:?} ({} tokens)",
                set.shards().len(),
                set.describe_format(),
                set.tokens()
            );
            Ok((EvalWindows::of_shards(set, t)?, vocab, description))
        }
        other => {
            let corpus = match other {
                Some(p) => Corpus::from_path(std::path::Path::new(p), tokenizer)?,
                None => Corpus::default_corpus(cfg.model.seed, tokenizer)?,
            };
            fits(corpus.vocab(), limit, &corpus.source.to_string())?;
            let description = format!("{} ({} tokens)", corpus.source, corpus.len());
            let w = EvalWindows::of_tokens(corpus.tokens(), t)?;
            Ok((w, corpus.vocab(), description))
        }
    }
}

/// The training and held-out windows, the vocabulary, a description and (for a corpus) the
/// unigram entropy of the training text, for `cfg`'s data (ids checked against `limit`, a
/// Hugging Face model's vocabulary, when given).
fn windows(
    cfg: &TrainConfig,
    tokenizer: &Tokenizer,
    limit: Option<usize>,
) -> Result<(Windows, Windows, usize, String, Option<f64>), TrainError> {
    let (b, t, seed) = (cfg.data.batch_size, cfg.model.seq_len, cfg.model.seed);
    let format = shard_format(cfg);
    match cfg.data.data.as_deref() {
        Some(pattern) if reads_shards(pattern)? => {
            let vocab = limit.unwrap_or_else(|| tokenizer.vocab());
            let set = Arc::new(ShardSet::open(pattern, format, vocab)?);
            let val = match &cfg.data.val_data {
                Some(v) => Some(Arc::new(ShardSet::open(v, format, vocab)?)),
                None => None,
            };
            let description = format!(
                "{} {} shards {pattern:?} ({} tokens{})",
                set.shards().len(),
                set.describe_format(),
                set.tokens(),
                val.as_ref().map_or(String::new(), |v| format!(
                    "; held out: {} tokens",
                    v.tokens()
                ))
            );
            let (train, heldout) = ShardWindows::split(set, t, HELDOUT_FRACTION, val)?;
            let seq = |windows| Windows::Sequential {
                windows,
                batch: b,
                origin: StreamOrigin::default(),
            };
            Ok((seq(train), seq(heldout), vocab, description, None))
        }
        other => {
            let corpus = match other {
                Some(p) => Corpus::from_path(std::path::Path::new(p), tokenizer)?,
                None => Corpus::default_corpus(seed, tokenizer)?,
            };
            fits(corpus.vocab(), limit, &corpus.source.to_string())?;
            let (train, heldout) = corpus_windows(&corpus, seed, b, t)?;
            let description = format!(
                "{} ({} tokens: {} train, {} held out)",
                corpus.source,
                corpus.len(),
                corpus.train().len(),
                corpus.heldout().len()
            );
            let entropy = Corpus::unigram_entropy(corpus.train());
            Ok((train, heldout, corpus.vocab(), description, Some(entropy)))
        }
    }
}

/// A GPT run and what its job prints about it.
pub struct GptJob {
    pub trainer: Trainer<Gpt>,
    pub tokenizer: Tokenizer,
    /// The unigram entropy of the training text (corpus data).
    pub entropy: Option<f64>,
    pub mesh: MeshLayout,
}

/// Builds the GPT of `cfg` on `mesh` (on `device`), its optimizer and its data from `inputs`;
/// needs an installed context.
pub fn gpt_trainer(
    cfg: &TrainConfig,
    mesh: MeshLayout,
    device: DeviceType,
    inputs: GptInputs,
) -> Result<GptJob, TrainError> {
    // The expert-parallel ranks are data-parallel ranks too (the batch split over both).
    let (pp, ep) = (mesh.size(AxisRole::Stages), mesh.size(AxisRole::Experts));
    let dp = mesh.size(AxisRole::Batch) * ep;
    let p = &cfg.parallel;
    // The stages as the mesh has them.
    let spec = PipelineSpec {
        stages: pp,
        ..p.pipeline_spec()
    };
    spec.validate(inputs.spec.cfg.layers)?;
    let (m, k, b) = (p.micro_batches, cfg.optim.grad_accum, cfg.data.batch_size);
    if !b.is_multiple_of(dp * m * k) {
        let accum = if k > 1 {
            format!(" x --grad-accum {k}")
        } else {
            String::new()
        };
        return Err(layout_err(format!(
            "--batch-size {b} must be a multiple of --dp {dp} x --micro-batches {m}{accum}"
        )));
    }
    let (stages, stage) = stages_of(&mesh, device)?;
    let rank = Context::current().map_or(0, |c| c.rank());
    let coord = |role| stages[stage].coord(rank, role).unwrap_or(0);
    let dp_coord = coord(AxisRole::Batch) * ep + coord(AxisRole::Experts);
    let pipelined = cfg.pipelined();
    let precision = cfg.precision(device)?;
    let mut model = build_decoder(&inputs.spec, &stages, spec.virtual_stages, &precision)?;
    model.recompute = p.recompute.into();
    let params = model.trainable_parameters();
    let decay = params
        .iter()
        .map(|q| {
            if model.decays(q) {
                cfg.optim.weight_decay
            } else {
                0.0
            }
        })
        .collect();
    let optimizer = AdamW::new(
        params,
        AdamWOptions {
            lr: cfg.optim.lr,
            weight_decay: cfg.optim.weight_decay,
            ..AdamWOptions::default()
        },
    )
    .with_zero(Zero::over(p.zero, &stages[stage])?)?
    .with_weight_decay(decay)?;
    let first = stages[0].clone();
    let last = stages[pp - 1].clone();
    let split = RowSplit {
        batch: b,
        dp,
        coord: dp_coord,
    };
    let windows = inputs.windows.ok_or_else(|| {
        layout_err("--eval-only opens no training windows: nothing to train on".into())
    })?;
    let data = GptData::new(windows, split, (first, last.clone()), inputs.description);
    let pipeline = pipelined
        .then(|| -> Result<PipelineRun, TrainError> {
            Ok(PipelineRun {
                spec,
                stage,
                world: mesh.world(device)?,
                last: last.placement().clone(),
            })
        })
        .transpose()?;
    let trainer = Trainer::new(
        model,
        Box::new(optimizer),
        Box::new(data),
        TrainOptions {
            schedule: cfg.lr_schedule(),
            clip_grad: cfg.optim.clip_grad,
            grad_accum: k,
            bucket_bytes: cfg.optim.bucket_bytes(),
            precision: Some(precision),
            pipeline,
            compile: cfg.run.compile,
        },
    )?;
    Ok(GptJob {
        trainer,
        tokenizer: inputs.tokenizer,
        entropy: inputs.entropy,
        mesh,
    })
}

/// `prompt`'s token ids, each below `vocab` (an id in the token table's padding would read a
/// row no training touched; one beyond it is out of range).
pub fn prompt_ids(
    tokenizer: &Tokenizer,
    prompt: &str,
    vocab: usize,
) -> Result<Vec<u32>, TrainError> {
    let ids = tokenizer.encode(prompt)?;
    match ids.iter().find(|&&id| id as usize >= vocab) {
        Some(bad) => Err(TrainError::Config {
            detail: format!(
                "--generate {prompt:?}: token {bad} is not below the vocabulary size {vocab}"
            ),
        }),
        None => Ok(ids),
    }
}
