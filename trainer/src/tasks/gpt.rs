//! The GPT task: `Gpt` as a `TrainModel` (decay on matrix weights only; embeddings, biases and
//! norms take none), `gpt_trainer`, which builds the model on the job's stages, its data
//! (corpus or token shards, through the chosen tokenizer) and optimizer, and `generate`.

use std::sync::Arc;

use oxiflow_collectives::DType;
use oxiflow_models::data::{
    Corpus, ShardFormat, ShardSet, ShardWindows, StreamOrigin, Tokenizer, Windows, HELDOUT_FRACTION,
};
use oxiflow_models::nn::gpt::{padded_vocab, Gpt, GptConfig, GptLayout, StageSplit, DP_AXIS};
use oxiflow_models::nn::{Module, Parameter, Pass};
use oxiflow_models::optim::{AdamW, AdamWOptions, Zero};
use oxiflow_models::pipeline::{PipelineModel, PipelineSpec, Schedule};
use oxiflow_placement::DeviceType;
use oxiflow_sbp::{NdSbp, Sbp};
use oxiflow_tensor::{no_grad, Context, Tensor};

use crate::config::{reads_shards, ReduceDtypeArg, ScheduleArg, ShardFormatArg, TrainConfig};
use crate::error::TrainError;
use crate::model::{Batch, TrainModel};
use crate::tasks::gpt_data::{corpus_windows, GptData, RowSplit};
use crate::tasks::mesh::Mesh;
use crate::trainer::{PipelineRun, TrainOptions, Trainer};

impl TrainModel for Gpt {
    fn loss(&self, batch: &Batch, pass: Pass) -> Result<Tensor, TrainError> {
        Ok(Gpt::loss(self, &batch.inputs, &batch.targets, pass)?)
    }
    fn pipeline(&self) -> Option<&dyn PipelineModel> {
        Some(self)
    }
    fn decays(&self, p: &Parameter) -> bool {
        let embedding = [self.wte.weight.name(), self.wpe.weight.name()].contains(&p.name());
        p.value().ndim() == 2 && !embedding
    }
    fn flops_per_token(&self) -> Option<f64> {
        // nanoGPT's estimate: 6 N + 12 L C T, N without the position table.
        let n: usize = self
            .parameters()
            .iter()
            .filter(|p| p.name() != self.wpe.weight.name())
            .map(|p| p.value().numel())
            .sum();
        let c = &self.cfg;
        Some(6.0 * n as f64 + 12.0 * (c.layers * c.width * c.seq_len) as f64)
    }
}

fn layout_err(detail: String) -> TrainError {
    TrainError::Layout { detail }
}

/// The GPT's data, opened and checked (every shard's header, size and ids) before the world
/// starts, so every rank refuses bad data alike without communicating.
pub struct GptInputs {
    pub train: Windows,
    pub heldout: Windows,
    pub vocab: usize,
    /// The token table's rows: `vocab` rounded up to a multiple of `--vocab-multiple`.
    pub table_rows: usize,
    pub description: String,
    /// The unigram entropy of the training text (corpus data).
    pub entropy: Option<f64>,
    pub tokenizer: Tokenizer,
}

impl GptInputs {
    /// `cfg`'s data through its tokenizer.
    pub fn open(cfg: &TrainConfig) -> Result<GptInputs, TrainError> {
        let tokenizer = cfg.data.tokenizer.open()?;
        let (train, heldout, vocab, description, entropy) = windows(cfg, &tokenizer)?;
        let multiple = cfg.model.vocab_multiple;
        let table_rows = padded_vocab(vocab, multiple).ok_or_else(|| TrainError::Config {
            detail: format!(
                "--vocab-multiple {multiple}: the vocabulary {vocab} rounded up to it overflows"
            ),
        })?;
        Ok(GptInputs {
            train,
            heldout,
            vocab,
            table_rows,
            description,
            entropy,
            tokenizer,
        })
    }
}

/// The training and held-out windows, the vocabulary, a description and (for a corpus) the
/// unigram entropy of the training text, for `cfg`'s data.
fn windows(
    cfg: &TrainConfig,
    tokenizer: &Tokenizer,
) -> Result<(Windows, Windows, usize, String, Option<f64>), TrainError> {
    let (b, t, seed) = (cfg.data.batch_size, cfg.model.seq_len, cfg.model.seed);
    let format = match cfg.data.shard_format {
        ShardFormatArg::Auto => ShardFormat::Auto,
        ShardFormatArg::Raw => ShardFormat::Raw,
        ShardFormatArg::Llmc => ShardFormat::Llmc,
    };
    match cfg.data.data.as_deref() {
        Some(pattern) if reads_shards(pattern)? => {
            let vocab = tokenizer.vocab();
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
    pub mesh: Mesh,
}

/// Builds the GPT of `cfg` on `mesh` (on `device`), its optimizer and its data from `inputs`;
/// needs an installed context.
pub fn gpt_trainer(
    cfg: &TrainConfig,
    mesh: Mesh,
    device: DeviceType,
    inputs: GptInputs,
) -> Result<GptJob, TrainError> {
    let (pp, dp, tp) = (mesh.pp, mesh.dp, mesh.tp);
    let p = &cfg.parallel;
    let spec = PipelineSpec {
        schedule: match p.schedule {
            ScheduleArg::Gpipe => Schedule::GPipe,
            ScheduleArg::OneFOneB => Schedule::OneFOneB,
            ScheduleArg::Interleaved => Schedule::Interleaved,
        },
        stages: pp,
        micro_batches: p.micro_batches,
        virtual_stages: p.virtual_stages,
    };
    spec.validate(cfg.model.layers)?;
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
    let rank = Context::current()
        .ok_or_else(|| layout_err("no runtime context".into()))?
        .rank();
    let stages = mesh.stages(device)?;
    let stage = stages
        .iter()
        .position(|s| s.contains(rank))
        .ok_or_else(|| {
            layout_err(format!(
                "rank {rank} is in no stage of the mesh [pp {pp}, dp {dp}, tp {tp}]"
            ))
        })?;
    let coord = stages[stage].coord_of(rank).unwrap_or_default();
    let dp_coord = coord.get(DP_AXIS).copied().unwrap_or(0);
    let mc = &cfg.model;
    let model_cfg = GptConfig {
        vocab: inputs.vocab,
        vocab_multiple: mc.vocab_multiple,
        seq_len: mc.seq_len,
        layers: mc.layers,
        heads: mc.heads,
        width: mc.width,
        dropout: mc.dropout,
        seed: mc.seed,
        dtype: match mc.dtype {
            crate::config::Precision::F32 => DType::F32,
            crate::config::Precision::F64 => DType::F64,
        },
        sequence_parallel: p.sp,
    };
    let pipelined = cfg.pipelined();
    let mut model = if pp == 1 && spec.virtual_stages == 1 {
        Gpt::new(&model_cfg, &GptLayout::Mesh(stages[0].clone()))?
    } else {
        let layouts = stages.iter().cloned().map(GptLayout::Mesh).collect();
        let split = StageSplit::new(model_cfg.layers, layouts, spec.virtual_stages)?;
        Gpt::new_split(&model_cfg, split)?
    };
    model.set_compute_dtype(cfg.compute_dtype(device));
    model.recompute = p.recompute.into();
    let params = model.parameters();
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
    .with_zero(Zero::new(p.zero, DP_AXIS)?)?
    .with_weight_decay(decay)?;
    let first = stages[0].clone();
    let last = stages[pp - 1].clone();
    let split = RowSplit {
        batch: b,
        dp,
        coord: dp_coord,
    };
    let data = GptData::new(
        (inputs.train, inputs.heldout),
        split,
        (first, last.clone()),
        inputs.description,
    );
    let pipeline = pipelined
        .then(|| -> Result<PipelineRun, TrainError> {
            Ok(PipelineRun {
                spec,
                stage,
                world: mesh.world(device)?,
                last,
            })
        })
        .transpose()?;
    let trainer = Trainer::new(
        model,
        Box::new(optimizer),
        Box::new(data),
        TrainOptions {
            schedule: crate::job::schedule_of(cfg),
            clip_grad: cfg.optim.clip_grad,
            grad_accum: k,
            bucket_bytes: cfg.optim.bucket_bytes(),
            reduce_dtype: cfg.optim.reduce_dtype.map(ReduceDtypeArg::dtype),
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

/// `prompt` continued by `n` tokens: greedy at temperature 0, else sampled from the softmax at
/// that temperature with draws from `seed` (every rank draws the same), over the vocabulary's
/// logits (never the table's padding).
pub fn generate(
    job: &GptJob,
    prompt: &str,
    n: usize,
    temperature: f64,
    seed: u64,
) -> Result<String, TrainError> {
    let _ng = no_grad();
    let model = &job.trainer.model;
    let t = model.cfg.seq_len;
    let (vocab, rows) = (model.cfg.vocab, model.cfg.table_rows());
    let mut ids = prompt_ids(&job.tokenizer, prompt, vocab)?;
    if ids.is_empty() {
        // An empty prompt starts a document: after the end-of-text token, else a newline.
        let start = match job.tokenizer.end_of_text() {
            Some(e) => vec![e],
            None => job.tokenizer.encode("\n")?,
        };
        ids.extend(start.first().filter(|&&id| (id as usize) < vocab));
        if ids.is_empty() {
            ids.push(0);
        }
    }
    let start = ids.len();
    let first = model
        .split
        .layout(0)
        .placement()
        .cloned()
        .ok_or_else(|| layout_err("the GPT is not global".into()))?;
    let sbp = NdSbp::new([Sbp::S(0), Sbp::B]);
    for i in 0..n {
        // The last t tokens, padded at the end: the causal mask hides the padding.
        let ctx = &ids[ids.len().saturating_sub(t)..];
        let mut row = vec![0i64; t];
        for (r, &c) in row.iter_mut().zip(ctx) {
            *r = i64::from(c);
        }
        let x = Tensor::from_vec(row, [1, t])?.to_global(&first, sbp.clone())?;
        let logits = model
            .forward(&x, Pass::Eval)?
            .narrow(0, 0, 1)?
            .narrow(1, ctx.len() - 1, 1)?
            .cast(DType::F64)?;
        let logits = match &job.trainer.opts.pipeline {
            None => logits.to_global(&first, NdSbp::broadcast(2))?,
            Some(run) => logits.to_global(&run.world, NdSbp::broadcast(1))?,
        }
        .to_vec::<f64>()?;
        if logits.len() != rows {
            return Err(layout_err(format!(
                "{} logits for a token table of {rows} rows (vocabulary {vocab})",
                logits.len()
            )));
        }
        let next = pick(&logits[..vocab], temperature, seed, i as u64);
        ids.push(u32::try_from(next).unwrap_or(0));
    }
    Ok(job.tokenizer.decode(&ids[start..])?)
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

/// The index of the next token: the arg-max at temperature 0, else a draw from
/// softmax(logits / temperature).
fn pick(logits: &[f64], temperature: f64, seed: u64, draw: u64) -> usize {
    let best =
        logits.iter().enumerate().fold(
            (0, f64::NEG_INFINITY),
            |a, (i, &v)| {
                if v > a.1 {
                    (i, v)
                } else {
                    a
                }
            },
        );
    if temperature <= 0.0 {
        return best.0;
    }
    let w: Vec<f64> = logits
        .iter()
        .map(|&v| ((v - best.1) / temperature).exp())
        .collect();
    let mut u = oxiflow_tensor::rng::uniform(seed, draw) * w.iter().sum::<f64>();
    for (i, x) in w.iter().enumerate() {
        if u < *x {
            return i;
        }
        u -= x;
    }
    best.0
}
