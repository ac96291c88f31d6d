//! `run`: a whole training job from a checked `TrainConfig`: the world, the mesh and device,
//! the model's task (GPT or MLP classifier), resuming, `--explain`, the loop (`drive`: step
//! lines, progress bar, held-out evaluations, checkpoints, metrics) and the closing lines, plot
//! and (GPT) generated sample. Outputs are created only once every input has been checked.

use std::path::{Path, PathBuf};

use oxiflow_collectives::env::{BackendChoice, CpuPlane, LaunchEnv};
use oxiflow_collectives::Backend;
use oxiflow_models::checkpoint::{self, SaveOptions, SaveStage};
use oxiflow_placement::{AxisRole, DeviceType, MeshLayout, NamedMesh};
use oxiflow_tensor::Context;

use crate::config::{
    CpAttentionArg, Dev, ModelKind, NonFiniteArg, Opt, PrecisionPolicy, TrainConfig, WorldBackend,
};
use crate::error::TrainError;
use crate::health::{HealthGuard, NonFinitePolicy};
use crate::model::TrainModel;
use crate::tasks::decoder::{build_decoder, stages_of, DecoderSpec};
use crate::tasks::eval::evaluate;
use crate::tasks::generate::{generate_with, DecodeSession, Sampling};
use crate::tasks::gpt::{gpt_trainer, prompt_ids, GptInputs};
use crate::tasks::mesh::job_mesh;
use crate::tasks::mlp::{classifier, ClassifierConfig, OptimizerKind};
use crate::trainer::{StepHook, Trainer};

mod drive;
mod history;
pub mod memory;
mod outputs;
mod preflight;
mod resume;
mod save_target;

pub use crate::config::{config_path, RESUME_AUTO};
use drive::{drive, report, Saver, Summary};
use outputs::{OutputPlan, RUN_ID_KEY};
use preflight::{check_inputs, Checked};
use resume::{load_options, Recorded};
pub use save_target::SaveTarget;

/// Seams for programs and tests: code run at each save stage (tests crash a save on purpose)
/// and on every step.
#[derive(Default)]
pub struct JobHooks {
    pub save_stage: Option<fn(SaveStage)>,
    pub step_hooks: Vec<Box<dyn StepHook>>,
}

/// Whether oflaunch draws the progress bar from this job's progress lines.
fn launcher_bar() -> bool {
    LaunchEnv::from_env().is_ok_and(|e| e.progress_lines)
}

/// The world of the launch environment on the chosen backend.
fn init_world(backend: WorldBackend) -> Result<Context, TrainError> {
    Ok(match backend {
        WorldBackend::Auto => oxiflow_cuda::init_from_env()?,
        chosen => {
            let mut env = LaunchEnv::from_env()?;
            env.backend = BackendChoice::Cpu;
            env.cpu_plane = match chosen {
                WorldBackend::Mpi => CpuPlane::Mpi,
                _ => CpuPlane::Tcp,
            };
            oxiflow_tensor::init_with_world(oxiflow_collectives::init_world(&env)?)
        }
    })
}

/// The device of the mesh when the launch environment already says (None: the world's start
/// decides): cpu when asked for, or on a CPU world (`--backend cpu|mpi`, `OXIFLOW_BACKEND=cpu`,
/// or a single process, which `auto` runs on the CPU backend); cuda when asked for.
fn device_before_world(cfg: &TrainConfig, env: &LaunchEnv) -> Option<DeviceType> {
    match (cfg.parallel.device, cfg.parallel.backend, env.backend) {
        (Dev::Cpu, _, _) => Some(DeviceType::Cpu),
        (Dev::Cuda, _, _) => Some(DeviceType::Cuda),
        (Dev::Auto, WorldBackend::Cpu | WorldBackend::Mpi, _) => Some(DeviceType::Cpu),
        (Dev::Auto, WorldBackend::Auto, BackendChoice::Cpu) => Some(DeviceType::Cpu),
        (Dev::Auto, WorldBackend::Auto, BackendChoice::Auto) if env.world_size == 1 => {
            Some(DeviceType::Cpu)
        }
        _ => None,
    }
}

/// The device of the mesh (a typed error for a matrix-product mode the device lacks).
fn device_of(cfg: &TrainConfig, ctx: &Context) -> Result<DeviceType, TrainError> {
    let device = match cfg.parallel.device {
        Dev::Cpu => DeviceType::Cpu,
        Dev::Cuda if oxiflow_cuda::bound_runtime().is_none() => {
            let backend = format!("{:?}", ctx.world().backend()).to_lowercase();
            return Err(TrainError::Layout {
                detail: format!(
                    "--device cuda needs a GPU bound to each rank, which an NCCL world does \
                     (oflaunch --backend nccl on a GPU machine); this world runs on {backend}"
                ),
            });
        }
        Dev::Cuda => DeviceType::Cuda,
        Dev::Auto if ctx.world().backend() == Backend::Nccl => DeviceType::Cuda,
        Dev::Auto => DeviceType::Cpu,
    };
    // The policy's matmul precision is an attribute of the model's products; TF32 and bf16
    // products are device modes, which a CPU run does not have.
    let matmul = cfg.precision(device)?.matmul();
    if device == DeviceType::Cpu && matmul != oxiflow_dtype::MatmulPrecision::F32 {
        let flag = cfg
            .parallel
            .precision
            .map_or("(default)", PrecisionPolicy::as_str);
        return Err(TrainError::Layout {
            detail: format!("--precision {flag} needs --device cuda (or auto on an NCCL world)"),
        });
    }
    if device == DeviceType::Cuda
        && cfg.parallel.precision.is_none()
        && cfg.model.dtype == oxiflow_dtype::DType::F64
    {
        // The device's default policy computes in bf16 over the f64 masters.
        tracing::warn!(
            "--dtype f64 on cuda keeps f64 master weights and computes in bf16 (the default \
             --precision bf16-mixed); --precision f64 computes everything in f64"
        );
    }
    Ok(device)
}

/// The configuration as one line per section, for the log.
fn config_lines(cfg: &TrainConfig) -> Result<Vec<String>, TrainError> {
    let text = cfg.to_toml()?;
    let mut lines = Vec::new();
    for l in text.lines().filter(|l| !l.trim().is_empty()) {
        if l.starts_with('[') {
            lines.push(format!("config {l}"));
        } else if let Some(last) = lines.last_mut() {
            last.push(' ');
            last.push_str(&l.replace(" = ", "="));
        }
    }
    Ok(lines)
}

/// `--resume auto`: the newest complete checkpoint at `--save`'s path (None: start fresh);
/// any other `--resume` as given.
fn resolve_resume(cfg: &TrainConfig) -> Result<Option<PathBuf>, TrainError> {
    match cfg.run.resume.as_deref() {
        Some(p) if p == Path::new(RESUME_AUTO) => match &cfg.run.save {
            Some(save) => Ok(checkpoint::newest_complete(SaveTarget::of(save).path())?),
            None => Err(TrainError::Config {
                detail: "--resume auto needs --save (where to look for checkpoints)".into(),
            }),
        },
        other => Ok(other.map(Path::to_path_buf)),
    }
}

/// Runs the job `cfg` describes on the launch environment's world. With `--resume auto` a
/// checkpoint that already reaches `--steps` means the job is done (a restart after the last
/// save): it says so and trains nothing.
pub fn run(cfg: &TrainConfig, hooks: JobHooks) -> Result<(), TrainError> {
    let auto = cfg.run.resume.as_deref() == Some(Path::new(RESUME_AUTO));
    let mut resolved = cfg.clone();
    resolved.run.resume = resolve_resume(cfg)?;
    let cfg = &resolved;
    if let (true, Some(p)) = (auto, &cfg.run.resume) {
        let step = checkpoint::read_manifest_at(p)?
            .metadata
            .get("step")
            .and_then(|s| s.parse::<u64>().ok());
        if let Some(step) = step.filter(|&s| s >= cfg.run.steps) {
            if LaunchEnv::from_env().map_or(true, |e| e.rank == 0) {
                println!(
                    "--resume auto: {} is at step {step}, which reaches --steps {}: nothing to train",
                    p.display(),
                    cfg.run.steps
                );
            }
            return Ok(());
        }
    }
    let Checked {
        inputs,
        outputs,
        recorded,
    } = check_inputs(cfg)?;
    let spec = inputs.as_ref().map(|i| i.spec.clone());
    // The layout and the host memory before any communication (so every rank refuses alike),
    // where the launch environment reads; the world's start reports one that does not.
    if let Ok(env) = LaunchEnv::from_env() {
        let mesh = job_mesh(&cfg.parallel, env.world_size)?;
        let device = device_before_world(cfg, &env);
        memory::check_host(cfg, &mesh, spec.as_ref(), device, env.local_world_size)?;
    }
    // The save path is this job's for its whole life: rank 0 holds its job lock, so a second
    // job saving there is refused now, not after it has trained.
    let rank0 = LaunchEnv::from_env().map_or(true, |e| e.rank == 0);
    let _held = match (&cfg.run.save, rank0) {
        (Some(p), true) => Some(checkpoint::JobLock::hold(SaveTarget::of(p).path())?),
        _ => None,
    };
    let ctx = init_world(cfg.parallel.backend)?;
    let world = ctx.world_size();
    let lead = ctx.rank() == 0;
    let mesh = job_mesh(&cfg.parallel, world)?;
    let device = device_of(cfg, &ctx)?;
    let local_ranks = LaunchEnv::from_env().map_or(1, |e| e.local_world_size);
    memory::check(cfg, &mesh, spec.as_ref(), device, local_ranks)?;
    if lead {
        for l in config_lines(cfg)? {
            println!("{l}");
        }
    }
    let job = Job {
        mesh,
        device,
        world,
        lead,
        hooks,
        outputs,
        recorded,
    };
    match inputs {
        Some(inputs) => gpt_job(cfg, inputs, job),
        None => mlp_job(cfg, job),
    }
}

/// The health guard `cfg` asks for (rank 0 prints its warnings).
fn health_guard(cfg: &TrainConfig, lead: bool) -> Box<dyn StepHook> {
    let policy = match cfg.run.on_nonfinite {
        NonFiniteArg::Stop => NonFinitePolicy::Stop,
        NonFiniteArg::Skip => NonFinitePolicy::Skip,
    };
    Box::new(HealthGuard::new(policy, cfg.run.loss_spike_factor, lead))
}

/// What saves the job's checkpoints: the recorded values and the run's id, `--save-gathered`,
/// the stage hook, the stages' named meshes (their axes' names recorded with each layout).
fn saver<'a>(
    cfg: &'a TrainConfig,
    recorded: &[Recorded],
    outputs: &OutputPlan,
    hook: Option<fn(SaveStage)>,
    meshes: Vec<NamedMesh>,
    lead: bool,
) -> Saver<'a> {
    let mut meta = resume::metadata(recorded);
    meta.insert(RUN_ID_KEY.into(), outputs.run_id.clone());
    Saver {
        cfg,
        meta,
        opts: SaveOptions {
            gathered: cfg.run.save_gathered,
            stage_hook: hook,
            meshes,
            ..SaveOptions::default()
        },
        lead,
    }
}

/// `--explain`: one step under the explain recorder, reported by rank 0.
fn explain_step<M: TrainModel>(t: &mut Trainer<M>, lead: bool) -> Result<(), TrainError> {
    oxiflow_tensor::explain::explain_start();
    let stats = t.train_step();
    let record = oxiflow_tensor::explain::explain_finish();
    let stats = stats?;
    if lead {
        println!("parameters (global shape on placement as nd-SBP):");
        for p in t.model.parameters() {
            let value = p.value();
            let layout = value
                .layout()
                .map_or_else(|| format!("local {}", value.describe()), |l| l.to_string());
            println!("  {:<24} {layout}", p.name());
        }
        println!("one training step (ops with their output layouts, boxings with their bytes):");
        print!("{}", record.render());
        let during = stats.buckets.iter().filter(|(_, b)| b.during_walk).count();
        println!(
            "gradient buckets: {} ({during} launched during the backward pass)",
            stats.buckets.len()
        );
        for (i, (part, b)) in stats.buckets.iter().enumerate() {
            let when = if b.during_walk {
                "during the backward pass"
            } else {
                "at its end"
            };
            let how = match b.target {
                oxiflow_tensor::BucketTarget::Broadcast => "all-reduce",
                oxiflow_tensor::BucketTarget::Shard => "reduce-scatter",
            };
            let how = match b.wire {
                Some(w) => format!("{how}({w})"),
                None => how.to_string(),
            };
            println!(
                "  bucket {i}: {} tensors {} bytes {how} part {part} {when}",
                b.tensors, b.bytes
            );
        }
        // Under --compile the step was captured: the program it compiled to, as replays run it.
        if let Some(c) = t.compiled.programs().last() {
            print!("{}", oxiflow_compile::explain(c));
        }
        println!("explained step loss {:.8}", stats.loss);
    }
    Ok(())
}

/// A job that trains nothing (`--eval-only`, or only generating): the decoder built (its
/// weights read from `--from-hf` when given, then from `--resume`'s checkpoint when given);
/// its loss over every window of the data under `--eval-only`; `--save-hf`; the sample.
fn infer_job(
    cfg: &TrainConfig,
    mesh: MeshLayout,
    device: DeviceType,
    inputs: GptInputs,
    lead: bool,
) -> Result<(), TrainError> {
    let (stages, _) = stages_of(&mesh, device)?;
    let spec = &inputs.spec;
    let model = build_decoder(
        spec,
        &stages,
        cfg.parallel.virtual_stages,
        &cfg.precision(device)?,
    )?;
    if let Some(path) = &cfg.run.resume {
        use oxiflow_models::nn::Module;
        let params = model.trainable_parameters();
        let targets: Vec<(String, oxiflow_tensor::Tensor)> = params
            .iter()
            .map(|p| (p.name().to_string(), p.value()))
            .collect();
        let (values, _) = checkpoint::load_tensors(path, &targets)?;
        for (p, v) in params.iter().zip(&values) {
            p.set_value(v)?;
        }
    }
    let world = mesh.world(device)?;
    if let Some(windows) = &inputs.eval {
        if lead {
            println!(
                "eval: {} | mesh {mesh} | data: {} tokenizer {} | {} windows of {} tokens, batch {}",
                spec.describe(),
                inputs.description,
                inputs.tokenizer,
                windows.len(),
                windows.seq_len() + 1,
                cfg.data.batch_size
            );
        }
        let r = evaluate(&model, windows, cfg.data.batch_size, &world)?;
        if lead {
            println!(
                "eval loss {} over {} tokens perplexity {}",
                r.loss,
                r.tokens,
                r.perplexity()
            );
            if let Some(aux) = r.router_aux {
                println!("eval router aux loss {aux}");
            }
        }
    } else if lead {
        println!("generate: {} | mesh {mesh}", spec.describe());
    }
    if let Some(dir) = &cfg.run.save_hf {
        save_hf(dir, cfg, spec, &model, lead)?;
    }
    let g = &cfg.generate;
    if !cfg.run.eval_only || g.generate.is_some() || g.prompt_ids.is_some() {
        let eos = spec.eos.clone();
        sample(
            cfg,
            &model,
            (inputs.tokenizer, inputs.vocab, &eos),
            &world,
            lead,
        )?;
    }
    Ok(())
}

/// The job's samples (after training, or alone): the text prompt (`--generate`, or "The "
/// when no `--prompt-ids` are given) and each of `--prompt-ids`, continued by `--gen-tokens`
/// tokens as `--temperature`, `--top-k` and `--top-p` say, ending at the model's
/// end-of-sequence ids; rank 0 prints the text and each continuation's ids.
fn sample(
    cfg: &TrainConfig,
    model: &oxiflow_models::nn::gpt::Gpt,
    (tokenizer, vocab, eos): (oxiflow_models::data::Tokenizer, usize, &[usize]),
    world: &oxiflow_placement::Placement,
    lead: bool,
) -> Result<(), TrainError> {
    let g = &cfg.generate;
    if g.gen_tokens == 0 {
        return Ok(());
    }
    let text = (g.generate.is_some() || g.prompt_ids.is_none()).then(|| cfg.prompt());
    let mut prompts: Vec<Vec<usize>> = Vec::new();
    if let Some(t) = text {
        let mut ids: Vec<usize> = prompt_ids(&tokenizer, t, vocab)?
            .into_iter()
            .map(|id| id as usize)
            .collect();
        if ids.is_empty() {
            // An empty prompt starts a document: after the end-of-text token, else a newline.
            let start = match tokenizer.end_of_text() {
                Some(e) => vec![e],
                None => tokenizer.encode("\n")?,
            };
            ids.extend(
                start
                    .first()
                    .map(|&id| id as usize)
                    .filter(|&id| id < vocab),
            );
            if ids.is_empty() {
                ids.push(0);
            }
        }
        prompts.push(ids);
    }
    prompts.extend(g.prompts());
    let sampling = Sampling {
        temperature: g.temperature,
        top_k: g.top_k,
        top_p: g.top_p,
        seed: cfg.model.seed,
    };
    let mut session = DecodeSession::default();
    let mut request = || {
        generate_with(
            &mut session,
            model,
            world,
            &prompts,
            g.gen_tokens,
            &sampling,
            eos,
        )
    };
    for _ in 0..g.gen_warmup {
        request()?;
    }
    let start = std::time::Instant::now();
    let (out, steps) = request()?;
    let secs = start.elapsed().as_secs_f64();
    if !lead {
        return Ok(());
    }
    let new: usize = out.iter().map(Vec::len).sum();
    let setup = steps.setup.as_secs_f64().min(secs);
    let warmed = match g.gen_warmup {
        0 => String::new(),
        w => format!(
            " after {w} untimed warm-up run{}",
            if w == 1 { "" } else { "s" }
        ),
    };
    println!(
        "generation: {new} new tokens for {} prompts in {secs:.3} s{warmed} ({:.1} new tokens/s, \
         the prompts' prefill included: {:.3} s; {setup:.3} s of it compiling the decoding step \
         and capturing its graph once, {:.1} new tokens/s without); decoding steps: {} compiled \
         ({} programs, {} replays as one device graph), {} eager, {} over a whole window, {} writing the cache in \
         place; ms a step: {}",
        out.len(),
        new as f64 / secs.max(f64::MIN_POSITIVE),
        steps.prefill.as_secs_f64(),
        new as f64 / (secs - setup).max(f64::MIN_POSITIVE),
        steps.compiled,
        steps.programs,
        steps.graph,
        steps.eager,
        steps.whole,
        steps.in_place,
        {
            let n = (steps.compiled + steps.eager).max(1) as f64;
            let ms = |d: std::time::Duration| d.as_secs_f64() * 1e3 / n;
            format!(
                "{:.3} run, {:.3} cache write, {:.3} reading ids",
                ms(steps.parts[0]),
                ms(steps.parts[1]),
                ms(steps.parts[2])
            )
        }
    );
    let ids_line = |ids: &[usize]| {
        let v: Vec<String> = ids.iter().map(usize::to_string).collect();
        format!("generated ids: {}", v.join(","))
    };
    for (i, ids) in out.iter().enumerate() {
        if let (0, Some(t)) = (i, text) {
            let decoded = match ids
                .iter()
                .map(|&id| u32::try_from(id))
                .collect::<Result<Vec<_>, _>>()
            {
                Ok(u) if ids.iter().all(|&id| id < tokenizer.vocab()) => tokenizer.decode(&u)?,
                _ => format!("[ids beyond the {} tokenizer's vocabulary]", tokenizer),
            };
            println!("sample (temperature {}): {t}{decoded}", g.temperature);
        }
        println!("{}", ids_line(ids));
    }
    Ok(())
}

/// `--save-hf DIR`: `model` written as a Hugging Face directory; with LoRA adapters, its
/// weights with the adapters merged in (`--merge-lora`) or the adapters alone in PEFT's layout
/// (every rank calls it).
fn save_hf(
    dir: &Path,
    cfg: &TrainConfig,
    spec: &DecoderSpec,
    model: &oxiflow_models::nn::gpt::Gpt,
    lead: bool,
) -> Result<(), TrainError> {
    use oxiflow_models::hf::{save_adapter, AdapterConfig};
    let config = spec.hf_config();
    let what = match &spec.lora {
        Some(l) if !cfg.run.merge_lora => {
            let adapter = AdapterConfig {
                rank: l.options.rank,
                alpha: l.options.alpha,
                target_modules: l.hf_modules(&spec.arch)?,
                base: spec.hf.as_ref().map(|h| h.dir.display().to_string()),
            };
            save_adapter(dir, &config, &adapter, &model.adapted())?;
            "LoRA adapters (PEFT layout)"
        }
        Some(_) => {
            let merged = model.merged_parameters()?;
            oxiflow_models::hf::save_hf(dir, &config, &merged, HF_SHARD_BYTES)?;
            "Hugging Face model, LoRA adapters merged,"
        }
        None => {
            use oxiflow_models::nn::Module;
            oxiflow_models::hf::save_hf(dir, &config, &model.parameters(), HF_SHARD_BYTES)?;
            "Hugging Face model"
        }
    };
    if lead {
        println!("saved a {what} to {}", dir.display());
    }
    Ok(())
}

/// The most bytes of one safetensors shard `--save-hf` writes.
const HF_SHARD_BYTES: usize = 2 << 30;

/// A checked job on its started world.
struct Job {
    mesh: MeshLayout,
    device: DeviceType,
    world: usize,
    lead: bool,
    hooks: JobHooks,
    outputs: OutputPlan,
    recorded: Vec<Recorded>,
}

impl Job {
    /// Resumes `t` from `--resume` (when given) and gives it the health guard and the job's
    /// step hooks.
    fn attach<M: TrainModel>(
        &mut self,
        cfg: &TrainConfig,
        t: &mut Trainer<M>,
    ) -> Result<(), TrainError> {
        if let Some(p) = &cfg.run.resume {
            t.resume_with(p, &load_options(cfg))?;
        }
        t.add_hook(health_guard(cfg, self.lead));
        for h in std::mem::take(&mut self.hooks.step_hooks) {
            t.add_hook(h);
        }
        Ok(())
    }

    /// `--explain`: one explained step (None); else the run driven to its end, saving with the
    /// job's saver, and its summary.
    fn train<M: TrainModel>(
        &self,
        cfg: &TrainConfig,
        t: &mut Trainer<M>,
    ) -> Result<Option<Summary>, TrainError> {
        if cfg.run.explain {
            return explain_step(t, self.lead).map(|()| None);
        }
        let meshes = self.mesh.stages(self.device)?;
        let hook = self.hooks.save_stage;
        let saver = saver(cfg, &self.recorded, &self.outputs, hook, meshes, self.lead);
        drive(t, cfg, &saver, &self.outputs, self.world, launcher_bar()).map(Some)
    }
}

fn gpt_job(cfg: &TrainConfig, inputs: GptInputs, mut run: Job) -> Result<(), TrainError> {
    let (device, world, lead) = (run.device, run.world, run.lead);
    if cfg.run.eval_only || cfg.generates_only() {
        return infer_job(cfg, run.mesh, device, inputs, lead);
    }
    let spec = inputs.spec.clone();
    let (tokenizer, vocab) = (inputs.tokenizer.clone(), inputs.vocab);
    let mut job = gpt_trainer(cfg, run.mesh.clone(), device, inputs)?;
    run.attach(cfg, &mut job.trainer)?;
    let mesh = &run.mesh;
    let m = &job.trainer.model.cfg;
    let p = &cfg.parallel;
    let cp_text = if mesh.size(AxisRole::Sequence) > 1 {
        match p.cp_attention {
            CpAttentionArg::Ring => " cp-attention ring",
            CpAttentionArg::Alltoall => " cp-attention alltoall",
        }
    } else {
        ""
    };
    if lead {
        let model = match (&spec.hf, cfg.model.model) {
            (None, ModelKind::Gpt) => format!(
                "gpt layers {} heads {} width {} seq-len {} vocab {} (table {} rows) dropout {} dtype {}",
                m.layers, m.heads, m.width, m.seq_len, m.vocab, m.table_rows(), m.dropout, m.dtype
            ),
            _ => format!("{} seq-len {}", spec.describe(), cfg.model.seq_len),
        };
        println!(
            "train: {model} | mesh {mesh}{cp_text} sp {} world {world} | micro-batches {} schedule {} virtual-stages {} grad-accum {} | batch {} lr {} schedule {} warmup {} clip {} seed {} from step {}",
            m.sequence_parallel,
            p.micro_batches, p.pipeline_spec().schedule, p.virtual_stages, cfg.optim.grad_accum,
            cfg.data.batch_size, cfg.optim.lr, format!("{:?}", cfg.optim.lr_schedule).to_lowercase(), cfg.optim.warmup_steps,
            cfg.optim.clip_grad.map_or("off".to_string(), |c| c.to_string()), m.seed, job.trainer.step
        );
        let entropy = job.entropy.map_or(String::new(), |u| {
            format!("; unigram entropy of the train split {u:.4} nats")
        });
        println!(
            "data: {} tokenizer {}{entropy}",
            job.trainer.data.describe(),
            job.tokenizer
        );
        if let Some(l) = &spec.lora {
            use oxiflow_models::nn::Module;
            let count = |ps: Vec<oxiflow_models::nn::Parameter>| -> usize {
                ps.iter().map(|p| p.value().numel()).sum()
            };
            let model = &job.trainer.model;
            println!(
                "lora: rank {} alpha {} targets {} | trainable parameters {} of {} ({} adapted layers; the rest frozen)",
                l.options.rank,
                l.options.alpha,
                l.targets.join(","),
                count(model.trainable_parameters()),
                count(model.parameters()),
                model.adapted().len()
            );
        }
    }
    let Some(summary) = run.train(cfg, &mut job.trainer)? else {
        return Ok(());
    };
    if lead {
        let theory = job.trainer.opts.pipeline.as_ref().map(|run| {
            let s = run.spec;
            (
                s.bubble_theory(),
                format!(
                    "schedule {}, pp {}, micro-batches {}, virtual-stages {}",
                    s.schedule, s.stages, s.micro_batches, s.virtual_stages
                ),
            )
        });
        report(cfg, &summary, job.entropy, theory);
    }
    if let Some(dir) = &cfg.run.save_hf {
        save_hf(dir, cfg, &spec, &job.trainer.model, lead)?;
    }
    let world = job.mesh.world(device)?;
    let eos = spec.eos.clone();
    sample(
        cfg,
        &job.trainer.model,
        (tokenizer, vocab, &eos),
        &world,
        lead,
    )
}

fn mlp_job(cfg: &TrainConfig, mut run: Job) -> Result<(), TrainError> {
    let (device, lead) = (run.device, run.lead);
    let m = &cfg.model;
    let ccfg = ClassifierConfig {
        mesh: Some((
            run.mesh.size(AxisRole::Batch),
            run.mesh.size(AxisRole::Heads),
        )),
        batch_size: cfg.data.batch_size,
        features: m.features,
        classes: m.classes,
        hidden: m.hidden,
        lr: cfg.optim.lr,
        momentum: cfg.optim.momentum,
        weight_decay: cfg.optim.weight_decay,
        optimizer: match cfg.optim.optimizer {
            Opt::Sgd => OptimizerKind::Sgd,
            Opt::Adamw => OptimizerKind::AdamW,
        },
        seed: m.seed,
        dtype: m.dtype,
        device,
        precision: Some(cfg.precision(device)?),
        ..ClassifierConfig::default()
    };
    let mut t = classifier(&ccfg)?;
    t.opts.compile = cfg.run.compile;
    t.opts.schedule = cfg.lr_schedule();
    t.opts.clip_grad = cfg.optim.clip_grad;
    t.opts.grad_accum = cfg.optim.grad_accum;
    t.opts.bucket_bytes = cfg.optim.bucket_bytes();
    // The global batch may split unevenly over dp; each accumulated part must be whole.
    if !cfg.data.batch_size.is_multiple_of(cfg.optim.grad_accum) {
        return Err(TrainError::Layout {
            detail: format!(
                "--batch-size {} must be a multiple of --grad-accum {}",
                cfg.data.batch_size, cfg.optim.grad_accum
            ),
        });
    }
    run.attach(cfg, &mut t)?;
    if lead {
        println!(
            "train: mlp features {} hidden {} classes {} | mesh {} world {} | batch {} lr {} schedule {} warmup {} clip {} grad-accum {} seed {} from step {}",
            m.features, m.hidden, m.classes, run.mesh, run.world, cfg.data.batch_size, cfg.optim.lr,
            format!("{:?}", cfg.optim.lr_schedule).to_lowercase(), cfg.optim.warmup_steps,
            cfg.optim.clip_grad.map_or("off".to_string(), |c| c.to_string()),
            cfg.optim.grad_accum, m.seed, t.step
        );
        println!("data: {}", t.data.describe());
    }
    if let Some(summary) = run.train(cfg, &mut t)? {
        if lead {
            report(cfg, &summary, None, None);
        }
    }
    Ok(())
}
