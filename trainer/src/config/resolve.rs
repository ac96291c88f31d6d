//! `resolve`: flags to a checked `TrainConfig`. Every value is checked here again (a job file
//! bypasses the command line's parsers), then the combinations; defaults depend on the model.

use std::collections::BTreeSet;

use oxiflow_dtype::DType;
use oxiflow_models::nn::gpt::DEFAULT_VOCAB_MULTIPLE;
use oxiflow_placement::DeviceType;

use super::checks;
use super::flags::*;
use super::{
    DataConfig, GenerateConfig, ModelConfig, OptimConfig, ParallelConfig, RunConfig, TrainConfig,
};
use crate::error::TrainError;

fn config_err(detail: String) -> TrainError {
    TrainError::Config { detail }
}

/// `check(value)` or an error naming `flag`.
fn checked<T, U>(flag: &str, v: T, check: fn(U) -> Result<U, String>) -> Result<T, TrainError>
where
    T: Copy + TryInto<U>,
{
    let u: U = v
        .try_into()
        .map_err(|_| config_err(format!("{flag}: out of range")))?;
    check(u).map_err(|e| config_err(format!("invalid value for {flag}: {e}")))?;
    Ok(v)
}

fn count(flag: &str, v: usize) -> Result<usize, TrainError> {
    checked(flag, v as u64, checks::positive).map(|_| v)
}

/// A finite value above 0, or an error naming `flag`.
fn positive_float(flag: &str, v: f64) -> Result<f64, TrainError> {
    checked(flag, v, checks::positive_finite)
}

/// `--bucket-mb` (0: no buckets); at most 1 TiB.
fn bucket_mb(mb: Option<f64>) -> Result<f64, TrainError> {
    let mb = checked("--bucket-mb", mb.unwrap_or(25.0), checks::non_negative)?;
    if mb > 1024.0 * 1024.0 {
        return Err(config_err(format!(
            "invalid value for --bucket-mb: {mb} is above 1048576 (1 TiB)"
        )));
    }
    Ok(mb)
}

/// A path or pattern that is not empty.
fn path<T: AsRef<std::ffi::OsStr> + Clone>(
    flag: &str,
    v: &Option<T>,
) -> Result<Option<T>, TrainError> {
    match v {
        Some(p) if p.as_ref().is_empty() => Err(config_err(format!(
            "invalid value for {flag}: an empty path"
        ))),
        other => Ok(other.clone()),
    }
}

pub(super) fn resolve(f: Flags, explicit: BTreeSet<String>) -> Result<TrainConfig, TrainError> {
    let kind = f.model.model.unwrap_or(ModelKind::Gpt);
    let gpt = kind.is_decoder();
    let m = &f.model;
    let model = ModelConfig {
        model: kind,
        layers: count("--layers", m.layers.unwrap_or(2))?,
        heads: count("--heads", m.heads.unwrap_or(4))?,
        width: count("--width", m.width.unwrap_or(64))?,
        seq_len: count("--seq-len", m.seq_len.unwrap_or(64))?,
        vocab_multiple: count(
            "--vocab-multiple",
            m.vocab_multiple.unwrap_or(DEFAULT_VOCAB_MULTIPLE),
        )?,
        dropout: checked("--dropout", m.dropout.unwrap_or(0.0), checks::unit_fraction)?,
        hidden: count("--hidden", m.hidden.unwrap_or(64))?,
        features: count("--features", m.features.unwrap_or(16))?,
        classes: checked(
            "--classes",
            m.classes.unwrap_or(4) as u64,
            checks::class_count,
        )? as usize,
        dtype: param_dtype(f.parallel.precision, m.dtype)?,
        seed: m.seed.unwrap_or(0),
        kv_heads: m.kv_heads.map(|k| count("--kv-heads", k)).transpose()?,
        ffn_width: m.ffn_width.map(|f| count("--ffn-width", f)).transpose()?,
        rope_theta: positive_float("--rope-theta", m.rope_theta.unwrap_or(10000.0))?,
        norm_eps: positive_float("--norm-eps", m.norm_eps.unwrap_or(1e-5))?,
        tie_embeddings: m.tie_embeddings,
        from_hf: path("--from-hf", &m.from_hf)?,
        lora_rank: m.lora_rank.map(|r| count("--lora-rank", r)).transpose()?,
        lora_alpha: positive_float("--lora-alpha", m.lora_alpha.unwrap_or(8.0))?,
        lora_targets: m.lora_targets.clone(),
        lora_dropout: checked(
            "--lora-dropout",
            m.lora_dropout.unwrap_or(0.0),
            checks::unit_fraction,
        )?,
    };
    if model.lora_dropout != 0.0 {
        return Err(config_err(format!(
            "--lora-dropout {}: adapters train without dropout; only 0 is supported",
            model.lora_dropout
        )));
    }
    let p = &f.parallel;
    let parallel = ParallelConfig {
        dp: p.dp.map(|d| count("--dp", d)).transpose()?,
        tp: count("--tp", p.tp.unwrap_or(1))?,
        pp: count("--pp", p.pp.unwrap_or(1))?,
        sp: p.sp,
        cp: count("--cp", p.cp.unwrap_or(1))?,
        ep: count("--ep", p.ep.unwrap_or(1))?,
        cp_attention: p.cp_attention.unwrap_or(CpAttentionArg::Ring),
        micro_batches: count("--micro-batches", p.micro_batches.unwrap_or(1))?,
        schedule: p.schedule.unwrap_or(ScheduleArg::OneFOneB),
        virtual_stages: count("--virtual-stages", p.virtual_stages.unwrap_or(1))?,
        zero: checked("--zero", p.zero.unwrap_or(0) as u64, checks::zero_stage)? as u8,
        recompute: p.recompute.unwrap_or(RecomputeArg::None),
        device: p.device.unwrap_or(Dev::Auto),
        backend: p.backend.unwrap_or(WorldBackend::Auto),
        precision: p.precision,
    };
    let d = &f.data;
    let data = DataConfig {
        data: path("--data", &d.data)?,
        val_data: path("--val-data", &d.val_data)?,
        tokenizer: d.tokenizer.clone().unwrap_or_default(),
        shard_format: d.shard_format.unwrap_or(ShardFormatArg::Auto),
        batch_size: count(
            "--batch-size",
            d.batch_size.unwrap_or(if gpt { 16 } else { 64 }),
        )?,
    };
    let o = &f.optim;
    let optimizer = o
        .optimizer
        .unwrap_or(if gpt { Opt::Adamw } else { Opt::Sgd });
    let lr = positive_float("--lr", o.lr.unwrap_or(if gpt { 5e-3 } else { 0.05 }))?;
    let r = &f.run;
    let steps = checked(
        "--steps",
        r.steps.unwrap_or(if gpt { 400 } else { 200 }),
        checks::positive,
    )?;
    let optim = OptimConfig {
        optimizer,
        lr,
        lr_schedule: o.lr_schedule.unwrap_or(LrScheduleArg::Constant),
        warmup_steps: o.warmup_steps.unwrap_or(0),
        min_lr: checked("--min-lr", o.min_lr.unwrap_or(0.0), checks::non_negative)?,
        weight_decay: checked(
            "--weight-decay",
            o.weight_decay
                .unwrap_or(if optimizer == Opt::Adamw { 0.01 } else { 0.0 }),
            checks::non_negative,
        )?,
        momentum: checked(
            "--momentum",
            o.momentum.unwrap_or(0.9),
            checks::unit_fraction,
        )?,
        clip_grad: o
            .clip_grad
            .map(|c| positive_float("--clip-grad", c))
            .transpose()?,
        grad_accum: count("--grad-accum", o.grad_accum.unwrap_or(1))?,
        bucket_mb: bucket_mb(o.bucket_mb)?,
        reduce_dtype: o
            .reduce_dtype
            .map(|d| checked("--reduce-dtype", d, checks::float_dtype))
            .transpose()?,
    };
    let positive_opt =
        |flag: &str, v: Option<u64>| v.map(|v| checked(flag, v, checks::positive)).transpose();
    let run = RunConfig {
        steps,
        log_every: checked("--log-every", r.log_every.unwrap_or(10), checks::positive)?,
        eval_every: positive_opt("--eval-every", r.eval_every)?,
        save: path("--save", &r.save)?,
        save_every: positive_opt("--save-every", r.save_every)?,
        save_gathered: r.save_gathered,
        resume: path("--resume", &r.resume)?,
        allow_resume_mismatch: r.allow_resume_mismatch,
        metrics: path("--metrics", &r.metrics)?,
        plot: path("--plot", &r.plot)?,
        overwrite: r.overwrite,
        peak_tflops: r
            .peak_tflops
            .map(|v| positive_float("--peak-tflops", v))
            .transpose()?,
        on_nonfinite: r.on_nonfinite.unwrap_or(NonFiniteArg::Stop),
        loss_spike_factor: checked(
            "--loss-spike-factor",
            r.loss_spike_factor.unwrap_or(4.0),
            checks::spike_factor,
        )?,
        explain: r.explain,
        compile: r.compile,
        eval_only: r.eval_only,
        save_hf: path("--save-hf", &r.save_hf)?,
        merge_lora: r.merge_lora,
    };
    let g = &f.generate;
    let generate = GenerateConfig {
        generate: g.generate.clone(),
        gen_tokens: checked(
            "--gen-tokens",
            g.gen_tokens.unwrap_or(120) as u64,
            checks::gen_tokens,
        )? as usize,
        gen_warmup: checked(
            "--gen-warmup",
            g.gen_warmup.unwrap_or(0) as u64,
            checks::gen_warmup,
        )? as usize,
        temperature: checked(
            "--temperature",
            g.temperature.unwrap_or(0.8),
            checks::non_negative,
        )?,
        prompt_ids: match &g.prompt_ids {
            Some(p) => Some(
                checks::prompt_ids(p)
                    .map(|_| p.clone())
                    .map_err(|e| config_err(format!("invalid value for --prompt-ids: {e}")))?,
            ),
            None => None,
        },
        top_k: g.top_k.unwrap_or(0),
        top_p: checked("--top-p", g.top_p.unwrap_or(1.0), checks::probability)?,
    };
    let cfg = TrainConfig {
        model,
        parallel,
        data,
        optim,
        run,
        generate,
        explicit,
        job_file: None,
    };
    check_combinations(&cfg)?;
    super::scope::refuse_unused(&cfg)?;
    // The precision policy on either device (the device may be known only at run time).
    for device in [DeviceType::Cpu, DeviceType::Cuda] {
        cfg.precision(device)?;
    }
    Ok(cfg)
}

/// The master weights' dtype: the one `--precision f32|f64|tf32` names, `--dtype` (checked:
/// f32 or f64) under bf16-mixed and the default policy, else f32; a `--dtype` that disagrees
/// with the policy's is refused with the spelling that says what was meant.
fn param_dtype(policy: Option<PrecisionPolicy>, dtype: Option<DType>) -> Result<DType, TrainError> {
    let dtype = dtype
        .map(|d| checked("--dtype", d, checks::param_dtype))
        .transpose()?;
    let named = policy.and_then(PrecisionPolicy::param);
    match (policy, named, dtype) {
        (Some(p), Some(n), Some(d)) if n != d => Err(config_err(format!(
            "--precision {} keeps everything in {n} and --dtype {d} asks for {d} master \
             weights: give --precision {d} (everything in {d}) or --precision bf16-mixed \
             --dtype {d} (bf16 compute over {d} master weights)",
            p.as_str()
        ))),
        (_, Some(n), _) => Ok(n),
        (_, None, d) => Ok(d.unwrap_or(DType::F32)),
    }
}

/// The checks that involve several values.
fn check_combinations(c: &TrainConfig) -> Result<(), TrainError> {
    let (o, r) = (&c.optim, &c.run);
    if o.warmup_steps > r.steps {
        return Err(config_err(format!(
            "--warmup-steps {} is beyond --steps {}",
            o.warmup_steps, r.steps
        )));
    }
    if o.min_lr > o.lr {
        return Err(config_err(format!(
            "--min-lr {} is above --lr {}",
            o.min_lr, o.lr
        )));
    }
    if r.save.is_none() {
        if r.save_every.is_some() {
            return Err(config_err("--save-every needs --save".into()));
        }
        if r.save_gathered {
            return Err(config_err("--save-gathered needs --save".into()));
        }
    }
    if r.resume.is_none() && r.allow_resume_mismatch {
        return Err(config_err("--allow-resume-mismatch needs --resume".into()));
    }
    if r.explain && (r.save.is_some() || r.resume.is_some()) {
        return Err(config_err(
            "--explain runs one step and saves nothing: drop --save and --resume".into(),
        ));
    }
    let p = &c.parallel;
    if p.virtual_stages > 1 && p.pp == 1 {
        return Err(config_err(format!(
            "--virtual-stages {} interleaves chunks of layers over pipeline stages, and --pp 1 \
             has one stage: give --pp 2 or more, or drop --virtual-stages",
            p.virtual_stages
        )));
    }
    if r.compile && c.model.dropout > 0.0 {
        return Err(config_err(format!(
            "--compile with --dropout {}: dropout masks are drawn per step, and a compiled step would replay the captured ones",
            c.model.dropout
        )));
    }
    if let Some(p) = &r.plot {
        let ext = p.extension().and_then(|e| e.to_str()).unwrap_or("");
        if !matches!(ext, "svg" | "png") {
            return Err(config_err(format!(
                "--plot {}: the file name must end in .svg or .png",
                p.display()
            )));
        }
    }
    let m = &c.model;
    let built = m.model.is_decoder() && m.from_hf.is_none();
    if built && !m.width.is_multiple_of(m.heads) {
        return Err(config_err(format!(
            "--width {} is not a multiple of --heads {}",
            m.width, m.heads
        )));
    }
    if built && !m.heads.is_multiple_of(c.parallel.tp) {
        return Err(config_err(format!(
            "--heads {} is not a multiple of --tp {}: the attention heads are split over the \
             tensor-parallel ranks",
            m.heads, c.parallel.tp
        )));
    }
    context_parallel_fits(c)?;
    expert_parallel_fits(c)?;
    if built && c.pipelined() {
        let p = &c.parallel;
        let spec = p.pipeline_spec();
        if let Err(e) = spec.validate(m.layers) {
            let why = match e {
                oxiflow_tensor::TensorError::Shape { detail, .. } => detail,
                other => other.to_string(),
            };
            return Err(config_err(format!(
                "the pipeline of --pp {} --micro-batches {} --schedule {} --virtual-stages {} \
                 over --layers {}: {why}",
                p.pp, p.micro_batches, spec.schedule, p.virtual_stages, m.layers
            )));
        }
    }
    if built && m.model == ModelKind::Llama {
        let kv = m.kv_heads.unwrap_or(m.heads);
        if !m.heads.is_multiple_of(kv) {
            return Err(config_err(format!(
                "--kv-heads {kv} does not divide --heads {}",
                m.heads
            )));
        }
        if !(m.width / m.heads).is_multiple_of(2) {
            return Err(config_err(format!(
                "--width {} / --heads {} is an odd head width, and rotary positions rotate pairs",
                m.width, m.heads
            )));
        }
    }
    if m.model.is_decoder() && o.optimizer == Opt::Sgd {
        return Err(config_err(format!(
            "--model {} trains with AdamW: drop --optimizer sgd",
            format!("{:?}", m.model).to_lowercase()
        )));
    }
    lora_fits(c)?;
    if r.eval_only && r.explain {
        return Err(config_err(
            "--eval-only and --explain both replace training: give one".into(),
        ));
    }
    Ok(())
}

/// LoRA fits the rest of the job: `--merge-lora` with adapters and `--save-hf`; eager steps
/// (a compiled step is not shown to equal an eager one with adapters).
fn lora_fits(c: &TrainConfig) -> Result<(), TrainError> {
    let r = &c.run;
    match c.model.lora_rank {
        None if r.merge_lora => Err(config_err(
            "--merge-lora merges LoRA adapters: it needs --lora-rank".into(),
        )),
        Some(_) if r.merge_lora && r.save_hf.is_none() => Err(config_err(
            "--merge-lora says how --save-hf writes the model: it needs --save-hf".into(),
        )),
        Some(rank) if r.compile => Err(config_err(format!(
            "--lora-rank {rank} with --compile: LoRA runs eagerly; drop --compile"
        ))),
        _ => Ok(()),
    }
}

/// An expert-parallel axis fits the rest of the layout: ranks drawn from the data-parallel
/// ones (ep divides dp). The model's experts are checked once its architecture is known.
fn expert_parallel_fits(c: &TrainConfig) -> Result<(), TrainError> {
    let p = &c.parallel;
    if p.ep == 1 {
        return Ok(());
    }
    if let Some(dp) = p.dp.filter(|d| !d.is_multiple_of(p.ep)) {
        return Err(config_err(format!(
            "--ep {} must divide --dp {dp}: the expert-parallel ranks are drawn from the \
             data-parallel ones",
            p.ep
        )));
    }
    Ok(())
}

/// A context-parallel axis fits the model and the rest of the layout: a sequence of at least
/// 2 x cp chunks (on CUDA, equal ones), no sequence parallelism beside it, and for alltoall
/// heads and kv heads that divide over the tp x cp ranks the all-to-all splits them over.
fn context_parallel_fits(c: &TrainConfig) -> Result<(), TrainError> {
    let (p, m) = (&c.parallel, &c.model);
    if p.cp == 1 {
        return Ok(());
    }
    if m.seq_len < 2 * p.cp {
        return Err(config_err(format!(
            "--seq-len {} is shorter than the 2 x --cp {} load-balanced chunks each sequence is \
             cut into",
            m.seq_len, p.cp
        )));
    }
    if p.sp {
        return Err(config_err(
            "--sp and --cp both split the sequence: give one of them".into(),
        ));
    }
    if p.device == Dev::Cuda && !m.seq_len.is_multiple_of(2 * p.cp) {
        return Err(config_err(format!(
            "--seq-len {} does not cut into 2 x --cp {} equal chunks, which the fused attention \
             on CUDA needs (each chunk meets the others as a square block): use a multiple of \
             {}",
            m.seq_len,
            p.cp,
            2 * p.cp
        )));
    }
    let kv = m.kv_heads.unwrap_or(m.heads);
    let ways = p.tp * p.cp;
    let built = m.model.is_decoder() && m.from_hf.is_none();
    if built
        && p.cp_attention == CpAttentionArg::Alltoall
        && (!m.heads.is_multiple_of(ways) || !kv.is_multiple_of(ways))
    {
        return Err(config_err(format!(
            "--cp-attention alltoall splits the attention heads over --tp {} x --cp {} = {ways} \
             ranks: --heads {} and the kv heads {kv} must both be divisible by {ways} (or use \
             --cp-attention ring)",
            p.tp, p.cp, m.heads
        )));
    }
    Ok(())
}
