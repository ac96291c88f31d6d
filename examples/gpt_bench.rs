//! `gpt_bench`: training throughput of OxiFlow's GPT on one GPU at GPT-2 shapes (124M by
//! default: 12 layers, width 768, 12 heads, vocabulary 50304, sequence 1024; another `--vocab`
//! gets its table padded to `--vocab-multiple` rows as `train` does), synthetic tokens,
//! AdamW with f32 master weights (lr 6e-4, betas 0.9/0.95, weight decay 0.1 on the matrices
//! but the embeddings), global-norm clipping at `--clip-grad` (1.0, as the PyTorch anchor; 0
//! turns it off), one full step (forward, backward, clipping, update) per iteration.
//!
//! ```text
//! oflaunch --nproc-per-node 1 --backend nccl gpt_bench --precision bf16-mixed --micro-batch 16
//! oflaunch --nproc-per-node 2 --backend nccl gpt_bench --dp 2 --micro-batch 8 --bucket-mb 25
//! oflaunch --nproc-per-node 2 --backend nccl gpt_bench --arch llama --cp 2 --seq 16384 --micro-batch 1
//! ```
//! With `--dp N` every GPU runs `--micro-batch` sequences of its own (tokens/s are per GPU) and
//! the gradients are all-reduced in `--bucket-mb` buckets during the backward pass (0: by the
//! optimizer after it).
//! Prints `RESULT {json}` with tokens/s, ms per step, MFU and peak device memory. MFU follows
//! the PyTorch anchor (`gpt2_bench.py`, nanoGPT's estimate): FLOPs per token
//! `6 N + 12 L d T` (N: parameters without the position table) over `--peak-tflops` (989,
//! dense bf16 on an H100/H200). `--profile` then runs a few more steps with per-op device
//! timing (a synchronisation around every op) and prints the ops by total time.
//! `--arch llama` trains the Llama family instead (RMSNorm, rotary positions, SwiGLU,
//! grouped-query attention with `--kv-heads`, `--ffn-width`, `--rope-theta`,
//! `--tie-embeddings`), e.g. Llama-3.2-1B's shape: `--arch llama --layers 16 --width 2048
//! --heads 32 --kv-heads 8 --ffn-width 8192 --vocab 128256 --tie-embeddings --seq 2048
//! --micro-batch 4`; its N counts every parameter (it has no position table), a tied table once.
//! `--experts E --top-k K` makes every block's MLP a Mixtral-style mixture of E experts of
//! `--ffn-width` (N then counts K of them: the parameters a token meets); with `--dp D --ep E`
//! the experts split over E of the D data-parallel GPUs (`train --ep`), e.g.
//! `oflaunch --nproc-per-node 2 --backend nccl gpt_bench --arch llama --experts 8 --dp 2 --ep 2`.

use std::time::{Duration, Instant};

use clap::{Parser, ValueEnum};
use oxiflow::compile::{CompiledStep, StepRun};
use oxiflow::cuda;
use oxiflow::nn::gpt::{
    Arch, Gpt, GptConfig, GptLayout, MoeArch, Pass, StageSplit, DEFAULT_VOCAB_MULTIPLE,
};
use oxiflow::nn::Module;
use oxiflow::optim::{AdamW, AdamWOptions, GradBuckets, Optimizer, SyncMode, Zero};
use oxiflow::placement::{MeshLayout, NamedMesh, CP, DP, EP, TP};
use oxiflow::prelude::*;
use oxiflow::trainer::compiled_step::compiled_passes;
use oxiflow::trainer::config::{PrecisionPolicy, RecomputeArg};
use oxiflow::trainer::tasks::gpt_data::rows_on_stage;
use oxiflow::trainer::TrainModel;

#[derive(Clone, Copy, Debug, PartialEq, Eq, ValueEnum)]
enum OnOff {
    On,
    Off,
}

/// The decoder family trained.
#[derive(Clone, Copy, Debug, PartialEq, Eq, ValueEnum)]
enum ArchArg {
    Gpt2,
    Llama,
}

#[derive(Parser, Debug)]
#[command(about = "GPT training throughput on one GPU")]
struct Args {
    #[arg(long, value_enum, default_value = "gpt2")]
    arch: ArchArg,
    /// Key/value heads of `--arch llama` (default: --heads).
    #[arg(long)]
    kv_heads: Option<usize>,
    /// The SwiGLU MLP's hidden width of `--arch llama` (default: 4 x --width).
    #[arg(long)]
    ffn_width: Option<usize>,
    /// Rotary base of `--arch llama`.
    #[arg(long, default_value_t = 500000.0)]
    rope_theta: f64,
    /// `--arch llama` reads its output through the token table.
    #[arg(long)]
    tie_embeddings: bool,
    /// `--arch llama` with a mixture of this many SwiGLU experts in every block (Mixtral's:
    /// softmax router, top-k renormalised, no shared expert, no load-balancing loss); 0: the
    /// dense MLP.
    #[arg(long, default_value_t = 0)]
    experts: usize,
    /// Experts each token is routed to.
    #[arg(long, default_value_t = 2)]
    top_k: usize,
    #[arg(long, default_value_t = 12)]
    layers: usize,
    #[arg(long, default_value_t = 768)]
    width: usize,
    #[arg(long, default_value_t = 12)]
    heads: usize,
    #[arg(long, default_value_t = 50304)]
    vocab: usize,
    /// The token table's rows are --vocab rounded up to a multiple of this (as `train
    /// --vocab-multiple`; 1: none).
    #[arg(long, default_value_t = DEFAULT_VOCAB_MULTIPLE)]
    vocab_multiple: usize,
    #[arg(long, default_value_t = 1024)]
    seq: usize,
    /// Sequences per step.
    #[arg(long, default_value_t = 8)]
    micro_batch: usize,
    #[arg(long, default_value_t = 3)]
    warmup: usize,
    /// Timed steps after the warm-up.
    #[arg(long, default_value_t = 10)]
    steps: usize,
    /// The mixed-precision policy (as `train --precision`).
    #[arg(long, value_enum, default_value_t = PrecisionPolicy::Bf16Mixed)]
    precision: PrecisionPolicy,
    /// Global-norm gradient clipping (0: none).
    #[arg(long, default_value_t = 1.0)]
    clip_grad: f64,
    #[arg(long, default_value_t = 989.0)]
    peak_tflops: f64,
    /// Device blocks from NCCL's allocator (`OXIFLOW_NCCL_MEMORY=1` in other programs) or the
    /// driver's (the default).
    #[arg(long, value_enum, default_value_t = OnOff::Off)]
    nccl_memory: OnOff,
    /// Device blocks of at least this many MiB go back to the driver's stream-ordered pool when
    /// freed, which serves any size from their bytes (0: every block cached by size; default:
    /// the library's `DRIVER_REUSE_FROM`).
    #[arg(long)]
    driver_reuse_mib: Option<f64>,
    /// AdamW's update written over the old parameters and state where nothing else holds them
    /// (the default), or into new memory (the same bits).
    #[arg(long, value_enum, default_value_t = OnOff::On)]
    update_in_place: OnOff,
    /// Steps timed op by op after the measurement (0: none).
    #[arg(long, default_value_t = 0)]
    profile: usize,
    /// Data-parallel ranks (the world size): each GPU runs `--micro-batch` sequences of
    /// its own.
    #[arg(long, default_value_t = 1)]
    dp: usize,
    /// Context-parallel ranks: each sequence's tokens split over this many GPUs in the
    /// load-balanced causal order, attention by the ring over them (the world is `dp x cp`;
    /// tokens/s and MFU are per GPU).
    #[arg(long, default_value_t = 1)]
    cp: usize,
    /// Expert-parallel ranks among the data-parallel ones (as `train --ep`): the experts of
    /// every mixture split over them, each token's rows sent to its experts' rank and back.
    #[arg(long, default_value_t = 1)]
    ep: usize,
    /// Data-parallel gradient buckets of this many MiB reduced during the backward pass; 0:
    /// each gradient all-reduced by the optimizer after the backward pass.
    #[arg(long, default_value_t = 25.0)]
    bucket_mb: f64,
    /// The dtype gradient buckets move as (bf16, f16, f32, f64; default: the gradients' own).
    #[arg(long)]
    reduce_dtype: Option<DType>,
    /// ZeRO stage over the data-parallel ranks (0: off; 1: AdamW's state sharded; 2: also
    /// the gradients, reduce-scattered; 3: also the parameters, gathered at use).
    #[arg(long, default_value_t = 0, value_parser = clap::value_parser!(u8).range(0..=3))]
    zero: u8,
    /// Under ZeRO-1/2, the updated shards gathered back into the parameters in buckets of
    /// this many MiB (0: one all-gather per parameter, the default).
    #[arg(long, default_value_t = 0.0)]
    gather_bucket_mb: f64,
    /// Forward and backward as a compiled program (captured on the first step, replayed on
    /// later ones, on CUDA as one CUDA graph from the third on, except under ZeRO-1/2, whose
    /// all-gathered parameters it reads launch by launch); clipping and AdamW run eagerly.
    #[arg(long)]
    compile: bool,
    /// What each block keeps for its backward pass, as `train --recompute` (gelu: the MLP's
    /// GELU output computed again, one `[B, T, 4C]` activation less a block).
    #[arg(long, value_enum, default_value = "none")]
    recompute: RecomputeArg,
    #[arg(long, default_value = "")]
    tag: String,
}

type R<T> = std::result::Result<T, Box<dyn std::error::Error>>;

/// Token ids of step `step`: `[b, t + 1]` from a 64-bit LCG, below GPT-2's 50257 real tokens.
fn tokens(b: usize, t: usize, vocab: usize, step: u64) -> Vec<i64> {
    let mut s = step
        .wrapping_mul(6364136223846793005)
        .wrapping_add(1442695040888963407);
    let top = vocab.min(50257) as u64;
    (0..b * (t + 1))
        .map(|_| {
            s = s
                .wrapping_mul(6364136223846793005)
                .wrapping_add(1442695040888963407);
            ((s >> 33) % top) as i64
        })
        .collect()
}

struct Bench {
    model: Gpt,
    opt: AdamW,
    /// Context-parallel ranks.
    cp: usize,
    /// Prints the device blocks' memory after the passes of each step.
    report_memory: bool,
    /// The mesh `[dp, ep, cp, tp]`.
    mesh: NamedMesh,
    /// Sequences per data-parallel rank.
    b: usize,
    t: usize,
    clip: Option<f64>,
    rank: usize,
    dp: usize,
    /// Bytes per gradient bucket (0: no buckets).
    bucket_bytes: usize,
    reduce_dtype: Option<DType>,
    /// The compiled passes (`--compile`).
    compiled: Option<CompiledStep>,
}

impl Bench {
    fn step(&mut self, step: u64) -> R<Tensor> {
        let (b, t) = (self.b, self.t);
        // This data-parallel rank's rows of the global batch, inputs and targets each laid out
        // as the activations (on a context-parallel axis: in the load-balanced order, split).
        let cp = self.cp;
        let seed = step * self.dp as u64 + (self.rank / cp) as u64;
        let ids = tokens(b, t, self.model.cfg.vocab, seed);
        let rows = |from: usize| -> R<Tensor> {
            let v: Vec<i64> = ids
                .chunks(t + 1)
                .flat_map(|row| row[from..from + t].to_vec())
                .collect();
            Ok(rows_on_stage(&self.mesh, v, [b, t])?)
        };
        let (x, y) = (rows(0)?, rows(1)?);
        self.opt.zero_grad();
        let loss = match self.compiled.take() {
            Some(mut compiled) => {
                let loss = self.compiled_passes(&mut compiled, &x, &y);
                self.compiled = Some(compiled);
                loss?
            }
            None => self.passes(&x, &y)?,
        };
        if self.report_memory {
            sync()?;
            let m = oxiflow::memory::device();
            println!(
                "MEMORY step {step} forward and backward: device blocks live {:.2} GiB, peak {:.2} GiB",
                gib(m.live),
                gib(m.peak)
            );
        }
        // As the PyTorch anchor's loop: the step's norm is never read, so the host does not
        // wait for the device between steps.
        self.opt.step_queued(self.clip)?;
        Ok(loss)
    }

    /// The forward and backward passes (gradients reduced in buckets during the backward with
    /// `--dp`): the loss; the gradients are on the leaves.
    fn passes(&self, x: &Tensor, y: &Tensor) -> R<Tensor> {
        // No dropout: the step number does not change the program.
        let loss = self.model.loss(x, y, Pass::Train { step: 0 })?;
        let buckets = (self.bucket_bytes > 0).then(|| {
            GradBuckets::new(
                self.opt.params(),
                self.opt.zero(),
                self.bucket_bytes,
                SyncMode::Reduce,
                self.reduce_dtype,
            )
        });
        let _hook = buckets.map(|b| oxiflow::install_grad_hook(b));
        loss.backward()?;
        Ok(loss)
    }

    /// [`Self::passes`] as a compiled program (`--compile`, see `compiled_passes`): prints the
    /// compile line and how replays run.
    fn compiled_passes(&self, c: &mut CompiledStep, x: &Tensor, y: &Tensor) -> R<Tensor> {
        let batch = vec![x.clone(), y.clone()];
        let done = compiled_passes(c, &self.opt, batch, || -> R<Vec<Tensor>> {
            Ok(vec![self.passes(x, y)?])
        })?;
        if let StepRun::Compiled(c) = &done.run {
            println!("{}", c.report);
        }
        for n in done.notes {
            println!("{n}");
        }
        done.outputs
            .into_iter()
            .next()
            .ok_or_else(|| "the compiled step gave no loss".into())
    }
}

/// `mb` MiB in bytes (rounded up); `flag` names it when it is not a finite value >= 0.
fn mib(mb: f64, flag: &str) -> R<usize> {
    if !(mb.is_finite() && mb >= 0.0) {
        return Err(format!("{flag} must be a finite value >= 0, got {mb}").into());
    }
    Ok((mb * 1024.0 * 1024.0).ceil() as usize)
}

/// `b` bytes in GiB.
fn gib(b: usize) -> f64 {
    b as f64 / (1u64 << 30) as f64
}

fn sync() -> R<()> {
    cuda::bound_runtime()
        .ok_or("no CUDA device bound")?
        .synchronize()?;
    Ok(())
}

fn main() -> R<()> {
    let a = Args::parse();
    let started = Instant::now();
    let ctx = oxiflow::init_from_env()?;
    if ctx.world_size() != a.dp * a.cp {
        return Err(format!(
            "gpt_bench --dp {} --cp {} runs on {} ranks, got {}",
            a.dp,
            a.cp,
            a.dp * a.cp,
            ctx.world_size()
        )
        .into());
    }
    let bucket_bytes = mib(a.bucket_mb, "--bucket-mb")?;
    let rt = cuda::bound_runtime()
        .ok_or("no CUDA device bound: run under `oflaunch --nproc-per-node 1 --backend nccl`")?;
    let param = a.precision.param().unwrap_or(DType::F32);
    let precision = a.precision.with_param(param)?;
    let precision = match a.reduce_dtype {
        Some(r) => precision.with_reduce(r)?,
        None => precision,
    };
    rt.set_nccl_memory(a.nccl_memory == OnOff::On);
    if let Some(mib) = a.driver_reuse_mib {
        rt.set_driver_reuse_from((mib > 0.0).then_some((mib * (1u64 << 20) as f64) as usize))?;
    }
    if a.ep == 0 || !a.dp.is_multiple_of(a.ep) {
        return Err(format!("gpt_bench --ep {} must divide --dp {}", a.ep, a.dp).into());
    }
    if a.ep > 1 && (a.experts == 0 || !a.experts.is_multiple_of(a.ep)) {
        return Err(format!(
            "gpt_bench --ep {} splits the experts of a mixture: --experts {} must be a multiple of it",
            a.ep, a.experts
        )
        .into());
    }
    let axes = [
        (DP, Some(a.dp / a.ep)),
        (EP, Some(a.ep)),
        (CP, Some(a.cp)),
        (TP, Some(1)),
    ];
    let mesh: NamedMesh = MeshLayout::resolve(&axes, a.dp * a.cp)?
        .stages(DeviceType::Cuda)?
        .pop()
        .ok_or("an empty mesh")?;
    let cfg = GptConfig {
        vocab: a.vocab,
        vocab_multiple: a.vocab_multiple,
        seq_len: a.seq,
        layers: a.layers,
        heads: a.heads,
        width: a.width,
        dropout: 0.0,
        seed: 1234,
        dtype: precision.param(),
        sequence_parallel: false,
        ..GptConfig::default()
    };
    let ffn = a.ffn_width.unwrap_or(4 * a.width);
    let arch = match a.arch {
        ArchArg::Gpt2 => Arch::gpt2(),
        ArchArg::Llama => Arch {
            tie_embeddings: a.tie_embeddings,
            moe: (a.experts > 0).then_some(MoeArch {
                experts: a.experts,
                top_k: a.top_k,
                renormalize: true,
                expert_width: ffn,
                shared_width: None,
                aux_loss_coef: 0.0,
            }),
            ..Arch::llama(a.kv_heads.unwrap_or(a.heads), ffn, a.rope_theta, 1e-5)
        },
    };
    let mut model = Gpt::with_arch(
        &cfg,
        &arch,
        StageSplit::single(a.layers, &GptLayout::Mesh(mesh.clone())),
    )?;
    model.recompute = a.recompute.into();
    model.set_precision(&precision)?;
    let params = model.parameters();
    let decay: Vec<f64> = params
        .iter()
        .map(|p| if model.decays(p) { 0.1 } else { 0.0 })
        .collect();
    let n_all: usize = params.iter().map(|p| p.value().numel()).sum();
    // The parameters a token meets: the position table is looked up, not multiplied; of the
    // experts, only its top-k.
    let idle_experts = a.layers * a.experts.saturating_sub(a.top_k) * 3 * a.width * ffn;
    let n_mfu = match a.arch {
        ArchArg::Gpt2 => n_all - a.seq * a.width,
        ArchArg::Llama => n_all - idle_experts,
    };
    let opt = AdamW::new(
        params,
        AdamWOptions {
            lr: 6e-4,
            beta1: 0.9,
            beta2: 0.95,
            eps: 1e-8,
            weight_decay: 0.1,
        },
    )
    .with_zero(
        Zero::over(a.zero, &mesh)?
            .with_gather_bytes(mib(a.gather_bucket_mb, "--gather-bucket-mb")?),
    )?
    .with_weight_decay(decay)?
    .with_in_place_update(a.update_in_place == OnOff::On);
    let mut bench = Bench {
        model,
        opt,
        mesh: mesh.clone(),
        cp: a.cp,
        report_memory: true,
        b: a.micro_batch,
        t: a.seq,
        clip: (a.clip_grad > 0.0).then_some(a.clip_grad),
        rank: ctx.rank(),
        dp: a.dp,
        bucket_bytes,
        reduce_dtype: Some(precision.reduce()),
        compiled: a.compile.then(CompiledStep::new),
    };
    let t_warm = Instant::now();
    println!(
        "TIMELINE first step at {:.0} ms after start",
        (t_warm - started).as_secs_f64() * 1e3
    );
    let mut step = 0u64;
    for _ in 0..a.warmup {
        oxiflow::memory::reset_peaks();
        bench.step(step)?;
        sync()?;
        let m = oxiflow::memory::device();
        println!(
            "MEMORY warm-up step {step}: device blocks live {:.2} GiB, peak {:.2} GiB; driver pool high-water {:.2} GiB; free lists {:.2} GiB; {} of {} parameters updated in place",
            gib(m.live),
            gib(m.peak),
            gib(rt.driver_pool_peak().unwrap_or(0)),
            gib(rt.cached_bytes()),
            bench.opt.updated_in_place(),
            bench.opt.params().len(),
        );
        step += 1;
    }
    bench.report_memory = false;
    let warm_s = t_warm.elapsed().as_secs_f64();
    println!(
        "MEMORY device blocks live after the warm-up {:.2} GiB",
        oxiflow::memory::device().live as f64 / (1u64 << 30) as f64
    );
    oxiflow::memory::reset_peaks();
    let c0 = rt.alloc_counts();
    let t0 = Instant::now();
    let mut loss = None;
    for _ in 0..a.steps {
        loss = Some(bench.step(step)?);
        step += 1;
    }
    sync()?;
    let dt = t0.elapsed().as_secs_f64() / a.steps.max(1) as f64;
    let last = match loss {
        Some(l) => l.to_vec::<f32>()?.first().copied().unwrap_or(f32::NAN),
        None => f32::NAN,
    };
    // Per GPU: a context-parallel group of `cp` GPUs shares each sequence.
    let tok_s = (a.micro_batch * a.seq) as f64 / dt / a.cp as f64;
    let flops_tok = 6.0 * n_mfu as f64 + 12.0 * (a.layers * a.width * a.seq) as f64;
    let mfu = tok_s * flops_tok / (a.peak_tflops * 1e12);
    let peak = oxiflow::memory::device().peak;
    let c1 = rt.alloc_counts();
    let n = a.steps.max(1) as f64;
    println!(
        "RESULT {{\"impl\":\"oxiflow\",\"tag\":\"{}\",\"compile\":{},\"dp\":{},\"ep\":{},\"cp\":{},\"zero\":{},\"bucket_mb\":{},\"reduce_dtype\":\"{}\",\"precision\":\"{:?}\",\"clip\":{},\"n_layer\":{},\"n_embd\":{},\"params_M\":{:.2},\"params_mfu_M\":{:.2},\"micro_batch\":{},\"seq\":{},\"ms_per_step\":{:.2},\"tokens_per_s\":{:.0},\"tflops\":{:.1},\"mfu\":{:.4},\"warmup_s\":{:.1},\"final_loss\":{:.4},\"peak_mem_GiB\":{:.2},\"cached_GiB\":{:.1},\"nccl_memory\":{},\"driver_allocs_per_step\":{:.1},\"given_back_per_step\":{:.1},\"full_releases_per_step\":{:.2},\"driver_reuse_mib\":{:.1},\"driver_pool_peak_GiB\":{:.2},\"device_used_GiB\":{:.2}}}",
        a.tag,
        a.compile,
        a.dp,
        a.ep,
        a.cp,
        a.zero,
        a.bucket_mb,
        a.reduce_dtype.map_or("own", |d| d.as_str()),
        a.precision,
        a.clip_grad,
        a.layers,
        a.width,
        n_all as f64 / 1e6,
        n_mfu as f64 / 1e6,
        a.micro_batch,
        a.seq,
        dt * 1e3,
        tok_s,
        tok_s * flops_tok / 1e12,
        mfu,
        warm_s,
        last,
        peak as f64 / (1u64 << 30) as f64,
        rt.cached_bytes() as f64 / (1u64 << 30) as f64,
        a.nccl_memory == OnOff::On,
        (c1.fresh - c0.fresh) as f64 / n,
        (c1.given_back - c0.given_back) as f64 / n,
        (c1.released_all - c0.released_all) as f64 / n,
        a.driver_reuse_mib
            .unwrap_or(cuda::DRIVER_REUSE_FROM as f64 / (1u64 << 20) as f64),
        rt.driver_pool_peak().unwrap_or(0) as f64 / (1u64 << 30) as f64,
        rt.memory_info()
            .map_or(0, |(free, total)| total.saturating_sub(free)) as f64
            / (1u64 << 30) as f64,
    );
    let live = oxiflow::memory::device().live;
    println!(
        "MEMORY device blocks live after the timed steps {:.2} GiB, peak during them {:.2} GiB, allocator cache {:.2} GiB",
        live as f64 / (1u64 << 30) as f64,
        peak as f64 / (1u64 << 30) as f64,
        rt.cached_bytes() as f64 / (1u64 << 30) as f64
    );
    println!(
        "UPDATE {} of {} parameters written in place by the last step",
        bench.opt.updated_in_place(),
        bench.opt.params().len()
    );
    if let Some(c) = &bench.compiled {
        for (i, p) in c.programs().iter().enumerate() {
            let n = p.replay_counts();
            println!(
                "COMPILED program {i}: {} replays launched its CUDA graph, {} ran launch by launch",
                n.graph, n.launches
            );
        }
    }
    let archs = cuda::embedded_kernel_archs();
    println!(
        "EMBEDDED KERNELS: {}",
        if archs.is_empty() {
            "none (this build compiles the library's kernels at run time)".to_string()
        } else {
            archs.join(", ")
        }
    );
    for b in cuda::kernel_builds() {
        println!(
            "KERNEL BUILD {}: {} {:.0} ms, load {:.0} ms, began {:.0} ms after start{}",
            b.what,
            b.origin,
            b.compile_ms,
            b.load_ms,
            b.started_at
                .saturating_duration_since(started)
                .as_secs_f64()
                * 1e3,
            if b.background { " (background)" } else { "" }
        );
    }
    if a.profile > 0 {
        cuda::reset_op_timings();
        cuda::set_op_timing(true);
        let t1 = Instant::now();
        for _ in 0..a.profile {
            bench.step(step)?;
            step += 1;
        }
        sync()?;
        cuda::set_op_timing(false);
        let wall = t1.elapsed().as_secs_f64() / a.profile as f64;
        let rows = cuda::op_timings();
        let total: f64 = rows.iter().map(|r| r.2).sum::<f64>() / a.profile as f64;
        println!(
            "PROFILE {:?}: {:.1} ms/step with a sync around each op, {:.1} ms inside ops",
            a.precision,
            wall * 1e3,
            total * 1e3
        );
        for (name, n, s) in rows.iter().take(20) {
            let per = s / a.profile as f64;
            println!(
                "PROFILE {:<22} {:>6} calls/step {:>8.2} ms/step {:>5.1}%",
                name,
                n / a.profile as u64,
                per * 1e3,
                100.0 * per / total.max(1e-12)
            );
        }
    }
    // With OXIFLOW_TRACE_DIR set (oflaunch --trace), this rank's timeline; else nothing.
    oxiflow::collectives::trace::write_rank_trace()?;
    // The process must not exit under the device's start-up builds.
    cuda::finish_background_builds(Duration::from_secs(120));
    Ok(())
}
