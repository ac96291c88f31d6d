//! `train`: a byte-level GPT on a text corpus (`--model gpt`, the default; `gpt.rs`,
//! `gpt_job.rs`) or an MLP classifier on a deterministic synthetic dataset (`--model mlp`;
//! `classifier.rs`), data parallel, tensor parallel or both on a mesh `[dp, tp]` of the
//! launched ranks (GPT: also sequence parallel with `--sp`, and pipeline stages on a mesh
//! `[pp, dp, tp]` with `--pp`, `--micro-batches`, `--schedule`, `--virtual-stages`).
//!
//! ```text
//! ./target/release/oflaunch --nproc-per-node 4 train                 # GPT, DP=4
//! ./target/release/oflaunch --nproc-per-node 4 train --dp 2 --tp 2   # DP=2 x TP=2
//! ./target/release/oflaunch --nproc-per-node 4 train --pp 2 --dp 2 --micro-batches 4  # PP=2 x DP=2
//! ./target/release/oflaunch --nproc-per-node 4 train --model mlp     # the MLP classifier
//! ./target/release/examples/train                                    # 1 rank, no launcher
//! mpirun -np 4 ./target/release/examples/train                       # under MPI (TCP data)
//! mpirun -np 4 ./target/release/examples/train --backend mpi         # MPI data plane
//! ```
//! Rank 0 prints `step N loss L` every `--log-every` steps and `final loss L steps/s S` (L: the
//! mean loss of the last 10 steps); GPT runs add tokens/s, the held-out loss, the unigram
//! entropy of the data and a generated sample.

// The tests share this module and use the parts `train` does not (Classifier::save/resume, cfg).
#[allow(dead_code)]
mod classifier;
mod gpt;
mod gpt_job;

use std::io::IsTerminal;
use std::path::{Path, PathBuf};
use std::time::Instant;

use clap::{Parser, ValueEnum};
use indicatif::{ProgressBar, ProgressStyle};
use std::sync::atomic::{AtomicUsize, Ordering};

use classifier::{Classifier, OptimizerKind, TrainConfig};
use oxiflow::checkpoint::{self, Metadata, SaveOptions, SaveStage};
use oxiflow::collectives::env::{BackendChoice, CpuPlane, LaunchEnv};
use oxiflow::collectives::Backend;
use oxiflow::pipeline::{PipelineSpec, Schedule};
use oxiflow::prelude::*;

#[derive(Clone, Copy, Debug, PartialEq, Eq, ValueEnum)]
enum ModelKind {
    /// A byte-level GPT on text.
    Gpt,
    /// The MLP classifier on Gaussian clusters.
    Mlp,
}

/// Counts host bytes, so `train` can print the peak of a step.
#[global_allocator]
static ALLOC: oxiflow::memory::CountingAllocator = oxiflow::memory::CountingAllocator;

#[derive(Clone, Copy, Debug, PartialEq, Eq, ValueEnum)]
enum RecomputeArg {
    None,
    Full,
    Selective,
}

#[derive(Clone, Copy, Debug, PartialEq, Eq, ValueEnum)]
enum ScheduleArg {
    /// All forwards, then all backwards.
    Gpipe,
    /// A warm-up of forwards, then one forward and one backward in turn.
    #[value(name = "1f1b")]
    OneFOneB,
    /// 1F1B over --virtual-stages chunks per stage (Megatron's interleaved schedule).
    Interleaved,
}

#[derive(Clone, Copy, Debug, PartialEq, Eq, ValueEnum)]
enum Opt {
    Sgd,
    Adamw,
}

/// Test hook: where to abort the process during the second save (crash-safety tests).
#[derive(Clone, Copy, Debug, ValueEnum)]
enum CrashStage {
    MidFile,
    BeforePublish,
    BetweenRenames,
}

static SAVES: AtomicUsize = AtomicUsize::new(0);
static CRASH_AT: AtomicUsize = AtomicUsize::new(0);

/// Aborts (like a kill) at the chosen stage of the second and later saves.
fn crash_hook(stage: SaveStage) {
    let code = match stage {
        SaveStage::MidFile => 1,
        SaveStage::BeforePublish => 2,
        SaveStage::BetweenRenames => 3,
    };
    if SAVES.load(Ordering::SeqCst) >= 2 && CRASH_AT.load(Ordering::SeqCst) == code {
        std::process::abort();
    }
}

#[derive(Clone, Copy, Debug, ValueEnum)]
enum Dev {
    /// cuda when the world runs on NCCL (oflaunch --backend auto on a GPU machine), else cpu.
    Auto,
    Cpu,
    Cuda,
}

#[derive(Clone, Copy, Debug, ValueEnum)]
enum WorldBackend {
    /// As the launch environment says (OXIFLOW_BACKEND, which oflaunch --backend sets).
    Auto,
    /// CPU processes over TCP and shared memory.
    Cpu,
    /// CPU processes over MPI (start with mpirun or srun; needs a build with --features mpi).
    Mpi,
}

#[derive(Clone, Copy, Debug, ValueEnum)]
enum Precision {
    F32,
    F64,
}

#[derive(Clone, Copy, Debug, ValueEnum)]
enum Matmul {
    F32,
    /// TF32 tensor cores, f32 inputs and outputs (cuda only).
    Tf32,
    /// bf16 inputs, f32 accumulation (cuda only).
    Bf16,
}

/// A count that must be at least 1.
fn positive_usize(s: &str) -> Result<usize, String> {
    match s.parse::<usize>() {
        Ok(0) => Err("must be at least 1".into()),
        Ok(n) => Ok(n),
        Err(e) => Err(format!("not a count: {e}")),
    }
}

/// A step count that must be at least 1.
fn positive_u64(s: &str) -> Result<u64, String> {
    match s.parse::<u64>() {
        Ok(0) => Err("must be at least 1".into()),
        Ok(n) => Ok(n),
        Err(e) => Err(format!("not a count: {e}")),
    }
}

/// A finite number above 0.
fn positive_finite(s: &str) -> Result<f64, String> {
    match s.parse::<f64>() {
        Ok(v) if v.is_finite() && v > 0.0 => Ok(v),
        Ok(v) => Err(format!("{v} is not a finite number above 0")),
        Err(e) => Err(format!("not a number: {e}")),
    }
}

/// A finite number in [0, 1).
fn unit_fraction(s: &str) -> Result<f64, String> {
    match s.parse::<f64>() {
        Ok(v) if (0.0..1.0).contains(&v) => Ok(v),
        Ok(v) => Err(format!("{v} is not in [0, 1)")),
        Err(e) => Err(format!("not a number: {e}")),
    }
}

/// At least 2 classes.
fn class_count(s: &str) -> Result<usize, String> {
    match s.parse::<usize>() {
        Ok(n) if n >= 2 => Ok(n),
        Ok(n) => Err(format!("{n} classes: a classifier needs at least 2")),
        Err(e) => Err(format!("not a count: {e}")),
    }
}

/// A number at least 0 (a sampling temperature; 0 is greedy).
fn temperature(s: &str) -> Result<f64, String> {
    match s.parse::<f64>() {
        Ok(v) if v.is_finite() && v >= 0.0 => Ok(v),
        Ok(v) => Err(format!("{v} is not a finite number at least 0")),
        Err(e) => Err(format!("not a number: {e}")),
    }
}

/// Train a GPT on text (or an MLP classifier on synthetic Gaussian clusters) with global tensors.
///
/// Every flag is checked before the run starts; nonsense (a learning rate of 0, NaN or
/// infinity, a batch of 0, a mesh that does not match the world) is refused with a message.
#[derive(Parser, Debug)]
#[command(name = "train", allow_negative_numbers = true)]
struct Args {
    /// The model to train.
    #[arg(long, value_enum, default_value_t = ModelKind::Gpt)]
    model: ModelKind,
    /// Data-parallel degree (mesh axis 0), at least 1. Default: world size / tp. dp x tp must
    /// equal the world size.
    #[arg(long, value_parser = positive_usize)]
    dp: Option<usize>,
    /// Tensor-parallel degree (mesh axis 1), at least 1.
    #[arg(long, default_value_t = 1, value_parser = positive_usize)]
    tp: usize,
    /// GPT: pipeline stages (mesh axis 0 of [pp, dp, tp]); pp x dp x tp must equal the world.
    #[arg(long, default_value_t = 1, value_parser = positive_usize)]
    pp: usize,
    /// GPT: micro-batches per step (the batch is split into this many; gradients accumulate).
    #[arg(long, default_value_t = 1, value_parser = positive_usize)]
    micro_batches: usize,
    /// GPT: pipeline schedule.
    #[arg(long, value_enum, default_value_t = ScheduleArg::OneFOneB)]
    schedule: ScheduleArg,
    /// GPT: chunks of layers per pipeline stage (interleaved schedule).
    #[arg(long, default_value_t = 1, value_parser = positive_usize)]
    virtual_stages: usize,
    /// Sequence parallelism (GPT): the residual stream split along the sequence on the
    /// tensor-parallel axis between blocks.
    #[arg(long)]
    sp: bool,
    /// Train until this step (a resumed run continues from its checkpoint's step). Default:
    /// 400 (gpt), 200 (mlp).
    #[arg(long, value_parser = positive_u64)]
    steps: Option<u64>,
    /// Global batch size (split over the data-parallel axis). Default: 16 windows (gpt), 64
    /// samples (mlp).
    #[arg(long, value_parser = positive_usize)]
    batch_size: Option<usize>,
    /// GPT: transformer blocks.
    #[arg(long, default_value_t = 2, value_parser = positive_usize)]
    layers: usize,
    /// GPT: attention heads (a multiple of --tp; divides --width).
    #[arg(long, default_value_t = 4, value_parser = positive_usize)]
    heads: usize,
    /// GPT: model width.
    #[arg(long, default_value_t = 64, value_parser = positive_usize)]
    width: usize,
    /// GPT: tokens per training window.
    #[arg(long, default_value_t = 64, value_parser = positive_usize)]
    seq_len: usize,
    /// GPT: ZeRO stage over the data-parallel axis: 1 shards optimizer state, 2 also
    /// gradients, 3 also parameters (gathered at use).
    #[arg(long, default_value_t = 0, value_parser = clap::value_parser!(u8).range(0..=3))]
    zero: u8,
    /// GPT: activation recomputation: none, full (every block) or selective (attention).
    #[arg(long, value_enum, default_value_t = RecomputeArg::None)]
    recompute: RecomputeArg,
    /// GPT: dropout probability, in [0, 1).
    #[arg(long, default_value_t = 0.0, value_parser = unit_fraction, allow_hyphen_values = true)]
    dropout: f64,
    /// GPT: a text file, or a pre-tokenized file (`OXFTOK16`, u32 vocabulary size, u16 ids;
    /// all little-endian). Default: the texts under /usr/share/common-licenses, else generated
    /// text.
    #[arg(long)]
    data: Option<PathBuf>,
    /// GPT: also print the held-out loss every this many steps.
    #[arg(long, value_parser = positive_u64)]
    eval_every: Option<u64>,
    /// GPT: the prompt of the generated sample. With --resume and no --steps: only generate.
    #[arg(long)]
    generate: Option<String>,
    /// GPT: tokens of the generated sample (0: none).
    #[arg(long, default_value_t = 120)]
    gen_tokens: usize,
    /// GPT: sampling temperature of the generated sample (0: greedy).
    #[arg(long, default_value_t = 0.8, value_parser = temperature, allow_hyphen_values = true)]
    temperature: f64,
    /// Width of the hidden layer (split over the tensor-parallel axis).
    #[arg(long, default_value_t = 64, value_parser = positive_usize)]
    hidden: usize,
    /// Number of input features.
    #[arg(long, default_value_t = 16, value_parser = positive_usize)]
    features: usize,
    /// Number of classes (at least 2).
    #[arg(long, default_value_t = 4, value_parser = class_count)]
    classes: usize,
    /// Learning rate (finite, above 0). Default: 0.005 (gpt, AdamW), 0.05 (mlp).
    #[arg(long, value_parser = positive_finite, allow_hyphen_values = true)]
    lr: Option<f64>,
    /// SGD momentum, in [0, 1).
    #[arg(long, default_value_t = 0.9, value_parser = unit_fraction, allow_hyphen_values = true)]
    momentum: f64,
    /// Optimizer (mlp; gpt always uses AdamW). Default: sgd.
    #[arg(long, value_enum)]
    optimizer: Option<Opt>,
    /// Element type of the model and data.
    #[arg(long, value_enum, default_value_t = Precision::F32)]
    dtype: Precision,
    /// Precision of f32 matrix products on GPUs.
    #[arg(long, value_enum, default_value_t = Matmul::F32)]
    matmul: Matmul,
    /// Device of the mesh placement: auto (cuda when the world runs on NCCL, else cpu), cpu,
    /// or cuda (one GPU per rank; needs the NCCL backend).
    #[arg(long, value_enum, default_value_t = Dev::Auto)]
    device: Dev,
    /// The backend of the world: auto (the launch environment decides), cpu, or mpi.
    #[arg(long, value_enum, default_value_t = WorldBackend::Auto)]
    backend: WorldBackend,
    /// Seed of the initial weights and of the dataset.
    #[arg(long, default_value_t = 0)]
    seed: u64,
    /// Save a checkpoint (directory) here at the end (and every --save-every steps). An
    /// existing path must be a checkpoint: anything else is refused, never replaced.
    #[arg(long)]
    save: Option<PathBuf>,
    /// Also save every this many steps (needs --save).
    #[arg(long, value_parser = positive_u64, requires = "save")]
    save_every: Option<u64>,
    /// Rank 0 writes whole tensors instead of every rank its pieces (needs --save).
    #[arg(long, requires = "save")]
    save_gathered: bool,
    /// Resume from a checkpoint saved under any layout; continues its step count up to --steps.
    /// Its seed and optimizer must match this run's.
    #[arg(long)]
    resume: Option<PathBuf>,
    /// Resume even if the checkpoint's seed or optimizer differ from this run's.
    #[arg(long, requires = "resume")]
    allow_resume_mismatch: bool,
    /// Print the loss every this many steps.
    #[arg(long, default_value_t = 10, value_parser = positive_u64)]
    log_every: u64,
    /// Run one training step and print (rank 0) every parameter's global shape, placement and
    /// SBP, every op's output (activation) layout and each boxing inserted with its bytes;
    /// then exit without training further or saving.
    #[arg(long, conflicts_with_all = ["save", "resume"])]
    explain: bool,
    /// Test hook: abort the process at this stage of the second save.
    #[arg(long, value_enum, hide = true)]
    crash_during_save: Option<CrashStage>,
}

fn optimizer_name(o: Opt) -> &'static str {
    match o {
        Opt::Sgd => "sgd",
        Opt::Adamw => "adamw",
    }
}

/// The MLP's optimizer (sgd unless --optimizer says otherwise).
fn mlp_optimizer(args: &Args) -> Opt {
    args.optimizer.unwrap_or(Opt::Sgd)
}

/// The MLP's step count.
fn mlp_steps(args: &Args) -> u64 {
    args.steps.unwrap_or(200)
}

/// Saves the model, optimizer state, step, seed and optimizer name (every rank calls).
fn save(clf: &Classifier, args: &Args, path: &Path, opts: &SaveOptions) -> oxiflow::Result<()> {
    let mut meta = Metadata::new();
    meta.insert("step".into(), clf.step.to_string());
    meta.insert("seed".into(), args.seed.to_string());
    meta.insert(
        "optimizer".into(),
        optimizer_name(mlp_optimizer(args)).into(),
    );
    checkpoint::save(
        path,
        &clf.parameters(),
        Some(clf.optimizer.as_ref()),
        &meta,
        opts,
    )
}

/// Checks that the checkpoint at `path` was saved by a run this one may continue: the same
/// seed and optimizer (unless --allow-resume-mismatch) and a step below --steps.
fn check_resume(args: &Args, path: &Path, meta: &Metadata) -> Result<u64, String> {
    let at = path.display();
    let step: u64 = meta
        .get("step")
        .ok_or_else(|| format!("--resume {at}: the checkpoint records no step"))?
        .parse()
        .map_err(|e| format!("--resume {at}: bad step: {e}"))?;
    let ours = [
        ("seed", args.seed.to_string(), "--seed"),
        (
            "optimizer",
            optimizer_name(mlp_optimizer(args)).to_string(),
            "--optimizer",
        ),
    ];
    for (key, want, flag) in ours {
        let saved = meta.get(key).map_or("(none)", String::as_str);
        if saved != want && !args.allow_resume_mismatch {
            return Err(format!(
                "--resume {at}: the checkpoint was saved with {key} {saved} but this run has {flag} {want}; \
                 pass {flag} {saved} or --allow-resume-mismatch"
            ));
        }
    }
    if step >= mlp_steps(args) {
        return Err(format!(
            "--resume {at}: the checkpoint is at step {step}, not below --steps {}",
            mlp_steps(args)
        ));
    }
    Ok(step)
}

/// Rank 0's progress bar (steps done of `steps`, elapsed time, ETA) from step `at`, when
/// stdout is a terminal (otherwise the step lines carry the progress).
fn progress_bar(lead: bool, steps: u64, at: u64) -> Option<ProgressBar> {
    (lead && std::io::stdout().is_terminal()).then(|| {
        let b = ProgressBar::new(steps);
        b.set_style(
            ProgressStyle::with_template("{bar:40} {pos}/{len} elapsed {elapsed} eta {eta} {msg}")
                .unwrap_or_else(|_| ProgressStyle::default_bar()),
        );
        b.set_position(at);
        b
    })
}

/// The mesh [pp, dp, tp] for a world of `world` ranks, or why the flags do not fit it.
fn mesh(args: &Args, world: usize) -> Result<(usize, usize, usize), String> {
    let (pp, tp) = (args.pp, args.tp);
    let dp = match args.dp {
        Some(dp) => dp,
        None if world.is_multiple_of(tp * pp) => world / (tp * pp),
        None => {
            return Err(format!(
                "--pp {pp} x --tp {tp} does not divide the world size {world}"
            ))
        }
    };
    if dp.checked_mul(tp).and_then(|n| n.checked_mul(pp)) != Some(world) {
        return Err(if pp == 1 {
            format!("--dp {dp} x --tp {tp} must equal the world size {world}")
        } else {
            format!("--pp {pp} x --dp {dp} x --tp {tp} must equal the world size {world}")
        });
    }
    Ok((pp, dp, tp))
}

fn run(args: Args) -> Result<(), Box<dyn std::error::Error>> {
    let ctx = match args.backend {
        WorldBackend::Auto => oxiflow::init_from_env()?,
        chosen => {
            let mut env = LaunchEnv::from_env()?;
            env.backend = BackendChoice::Cpu;
            env.cpu_plane = match chosen {
                WorldBackend::Mpi => CpuPlane::Mpi,
                _ => CpuPlane::Tcp,
            };
            oxiflow::init_with_world(oxiflow::collectives::init_world(&env)?)
        }
    };
    let world = ctx.world_size();
    let (pp, dp, tp) = mesh(&args, world)?;
    let dtype = match args.dtype {
        Precision::F32 => DType::F32,
        Precision::F64 => DType::F64,
    };
    let device = match args.device {
        Dev::Cpu => DeviceType::Cpu,
        Dev::Cuda => DeviceType::Cuda,
        Dev::Auto if ctx.world().backend() == Backend::Nccl => DeviceType::Cuda,
        Dev::Auto => DeviceType::Cpu,
    };
    let precision = match args.matmul {
        Matmul::F32 => None,
        Matmul::Tf32 => Some(oxiflow::cuda::MatmulPrecision::Tf32),
        Matmul::Bf16 => Some(oxiflow::cuda::MatmulPrecision::Bf16),
    };
    match (precision, device) {
        (Some(p), DeviceType::Cuda) => {
            let rt = oxiflow::cuda::bound_runtime()
                .ok_or("--matmul needs a CUDA device bound to this process")?;
            rt.set_matmul_precision(p);
        }
        (Some(p), DeviceType::Cpu) => {
            let name = format!("{p:?}").to_lowercase();
            return Err(
                format!("--matmul {name} needs --device cuda (or auto on an NCCL world)").into(),
            );
        }
        (None, _) => {}
    }
    if args.model == ModelKind::Gpt {
        if args.optimizer == Some(Opt::Sgd) {
            return Err("--model gpt trains with AdamW: drop --optimizer sgd".into());
        }
        let cfg = gpt::GptTrainConfig {
            mesh: (dp, tp),
            model: oxiflow::nn::gpt::GptConfig {
                vocab: oxiflow::data::ByteTokenizer::VOCAB,
                seq_len: args.seq_len,
                layers: args.layers,
                heads: args.heads,
                width: args.width,
                dropout: args.dropout,
                seed: args.seed,
                dtype,
                sequence_parallel: args.sp,
            },
            batch_size: args.batch_size.unwrap_or(gpt_job::BATCH_SIZE),
            lr: args.lr.unwrap_or(gpt_job::LR),
            data: args.data.clone(),
            device,
            zero: args.zero,
            recompute: match args.recompute {
                RecomputeArg::None => oxiflow::nn::gpt::Recompute::None,
                RecomputeArg::Full => oxiflow::nn::gpt::Recompute::Full,
                RecomputeArg::Selective => oxiflow::nn::gpt::Recompute::Selective,
            },
            pipeline: PipelineSpec {
                schedule: match args.schedule {
                    ScheduleArg::Gpipe => Schedule::GPipe,
                    ScheduleArg::OneFOneB => Schedule::OneFOneB,
                    ScheduleArg::Interleaved => Schedule::Interleaved,
                },
                stages: pp,
                micro_batches: args.micro_batches,
                virtual_stages: args.virtual_stages,
            },
        };
        return gpt_job::run(&args, cfg, world, ctx.rank() == 0);
    }
    if args.sp {
        return Err("--sp needs --model gpt".into());
    }
    if pp > 1 || args.micro_batches > 1 || args.virtual_stages > 1 {
        return Err("--pp, --micro-batches and --virtual-stages need --model gpt".into());
    }
    let steps = mlp_steps(&args);
    let cfg = TrainConfig {
        mesh: Some((dp, tp)),
        batch_size: args.batch_size.unwrap_or(64),
        features: args.features,
        classes: args.classes,
        hidden: args.hidden,
        lr: args.lr.unwrap_or(0.05),
        momentum: args.momentum,
        optimizer: match mlp_optimizer(&args) {
            Opt::Sgd => OptimizerKind::Sgd,
            Opt::Adamw => OptimizerKind::AdamW,
        },
        seed: args.seed,
        dtype,
        device,
        ..TrainConfig::default()
    };
    let mut clf = Classifier::new(&cfg)?;
    if let Some(p) = &args.resume {
        let manifest = checkpoint::read_manifest_at(p)?;
        let step = check_resume(&args, p, &manifest.metadata)?;
        checkpoint::load(p, &clf.parameters(), Some(clf.optimizer.as_mut()))?;
        clf.step = step;
    }
    let lead = ctx.rank() == 0;
    if args.explain {
        return explain_step(&mut clf, lead);
    }
    let bar = progress_bar(lead, steps, clf.step);
    let say = |line: String| match &bar {
        Some(b) => b.println(line),
        None => println!("{line}"),
    };
    if lead {
        say(format!("train: mesh [dp {dp}, tp {tp}] world {world} batch {} hidden {} lr {} seed {} from step {}", cfg.batch_size, cfg.hidden, cfg.lr, cfg.seed, clf.step));
    }
    if let Some(c) = args.crash_during_save {
        CRASH_AT.store(c as usize + 1, Ordering::SeqCst);
    }
    let save_opts = SaveOptions {
        gathered: args.save_gathered,
        stage_hook: Some(crash_hook),
    };
    let start = Instant::now();
    let first = clf.step;
    let mut last = f64::NAN;
    let mut recent: std::collections::VecDeque<f64> = std::collections::VecDeque::new();
    while clf.step < steps {
        last = clf.train_step()?;
        recent.push_back(last);
        if recent.len() > 10 {
            recent.pop_front();
        }
        let n = clf.step;
        if lead && (n % args.log_every == 0 || n == steps) {
            say(format!("step {n} loss {last:.8}"));
        }
        if let Some(b) = &bar {
            b.set_position(n);
            b.set_message(format!("loss {last:.4}"));
        }
        if let (Some(p), Some(every)) = (&args.save, args.save_every) {
            if n % every == 0 && n < steps {
                SAVES.fetch_add(1, Ordering::SeqCst);
                save(&clf, &args, p, &save_opts)?;
            }
        }
    }
    let secs = start.elapsed().as_secs_f64();
    if let Some(p) = &args.save {
        SAVES.fetch_add(1, Ordering::SeqCst);
        save(&clf, &args, p, &save_opts)?;
    }
    if let Some(b) = &bar {
        b.finish_and_clear();
    }
    if lead {
        let sps = (clf.step - first) as f64 / secs.max(1e-9);
        // The final loss is the mean over the last (up to) 10 steps: one batch is noisy.
        let fin = if recent.is_empty() {
            last
        } else {
            recent.iter().sum::<f64>() / recent.len() as f64
        };
        println!("final loss {fin:.8} steps/s {sps:.2}");
    }
    Ok(())
}

/// `--explain`: one step under the explain recorder, reported by rank 0.
fn explain_step(clf: &mut Classifier, lead: bool) -> Result<(), Box<dyn std::error::Error>> {
    oxiflow::explain::explain_start();
    let loss = clf.train_step();
    let record = oxiflow::explain::explain_finish();
    let loss = loss?;
    if lead {
        println!("parameters (global shape on placement as nd-SBP):");
        for p in clf.parameters() {
            let value = p.value();
            let layout = value
                .layout()
                .map_or_else(|| format!("local {}", value.describe()), |l| l.to_string());
            println!("  {:<24} {layout}", p.name());
        }
        println!("one training step (ops with their output layouts, boxings with their bytes):");
        print!("{}", record.render());
        println!("explained step loss {loss:.8}");
    }
    Ok(())
}

fn main() {
    let args = Args::parse();
    let result = run(args);
    // With OXIFLOW_TRACE_DIR set (oflaunch --trace), this rank's timeline; else nothing.
    if let Err(e) = oxiflow::collectives::trace::write_rank_trace() {
        eprintln!("train: {e}");
    }
    if let Err(e) = result {
        eprintln!("train: {e}");
        std::process::exit(1);
    }
}
