//! The memory a job needs on each rank, estimated from its configuration before anything big
//! is allocated, against what the host or the device has: a job that cannot fit is refused in
//! milliseconds, naming the flags that size the largest part, instead of aborting on a failed
//! allocation or driving the machine into swap and the OOM killer.
//!
//! The estimate is a lower bound (what the heaviest rank needs at least), in bytes, with `s`
//! the element size of `--dtype`, `a` that of the activations (2 under `--precision
//! bf16-mixed`, else `s`), `r` this rank's rows of one micro-batch part, and pp, dp, tp the
//! sizes of the mesh axes that split the stages, the batch and the heads (a sequence axis
//! divides each window's T among its ranks):
//!
//! - Decoder (width C, layers L, heads H, window T, V rows of the token table: the vocabulary
//!   padded to `--vocab-multiple`): N parameters as the architecture counts them
//!   (`Arch::parameter_count`; GPT-2's N = V C + T C + L (12 C^2 + 13 C) + 2 C);
//!   each rank holds at least N / (pp tp) of them (N / (pp dp tp) under ZeRO-3), as many
//!   gradients (/ dp from ZeRO-2) and twice as much AdamW state (/ dp from ZeRO-1); under
//!   LoRA only the adapters' parameters have gradients and state, the frozen rest one copy
//!   in the compute dtype.
//!   r = B / (dp M K) rows (batch B, micro-batches M, accumulation K) of T tokens keep, per
//!   token, the logits and their softmax (2 V / tp) and, for each of the ceil(L / pp) blocks
//!   of a stage, what its backward pass needs: b = 4 C + 12 C / tp (+ the attention's
//!   log-sum-exp, H / tp values of at least 4 bytes; no probabilities), or 2 C + 8 C / tp
//!   under selective recomputation, or C under full recomputation (then plus one block's b
//!   while it reruns), or b - 4 C under GELU recomputation without tensor parallelism; times
//!   `a`. Their token ids take 16 r T bytes (inputs and targets,
//!   i64). Measured peaks are about twice this (the temporaries of each op are not counted).
//!   An evaluation (`--eval-only`) needs the parameters, one batch's logits and ids only.
//! - MLP (features F, hidden Hd, classes K): N = F Hd + Hd + Hd K + K parameters, N / tp per
//!   rank, as many gradients and N / tp (SGD momentum) or 2 N / tp (AdamW) of state;
//!   r = B / dp rows have activations of at least a r (F + 2 Hd / tp + 2 K) and 16 r bytes of
//!   labels.
//!
//! On the CPU every part is host memory, needed once per rank on the host (LOCAL_WORLD_SIZE),
//! against the host's available memory: `/proc/meminfo`'s MemAvailable, lowered to what the
//! cgroup's limit leaves (v2 `memory.max - memory.current`, v1 `memory.limit_in_bytes -
//! memory.usage_in_bytes`), in steps of 256 MiB so that ranks reading it moments apart agree;
//! and each rank's host parts against what its address-space limit leaves (`RLIMIT_AS`,
//! `ulimit -v`, less the process's mapped size, VmSize). The refusal names the limit that binds.
//! On a GPU the parameters, gradients, state and activations are
//! device memory, against the free memory of the rank's device (`cuMemGetInfo`, plus the
//! allocator's cached blocks), and the token ids stay host memory.

use std::path::{Path, PathBuf};

use oxiflow_dtype::DType;
use oxiflow_placement::{AxisRole, DeviceType, MeshLayout};

use crate::config::{ModelKind, Opt, RecomputeArg, TrainConfig};
use crate::error::TrainError;
use crate::tasks::decoder::DecoderSpec;

/// What one rank needs at least, in bytes (see the module's documentation).
#[derive(Clone, Copy, Debug, Default, PartialEq)]
pub struct Estimate {
    pub parameters: f64,
    pub gradients: f64,
    pub optimizer_state: f64,
    pub activations: f64,
    /// Token ids or labels (always host memory).
    pub batches: f64,
}

impl Estimate {
    /// The parts that live on the model's device.
    pub fn model(&self) -> f64 {
        self.parameters + self.gradients + self.optimizer_state + self.activations
    }
    pub fn total(&self) -> f64 {
        self.model() + self.batches
    }
}

fn ceil_div(a: f64, b: f64) -> f64 {
    (a / b.max(1.0)).ceil()
}

/// The estimate for `cfg` on `mesh` with the decoder `decoder` (None for the MLP) on `device`.
pub fn estimate(
    cfg: &TrainConfig,
    mesh: &MeshLayout,
    decoder: Option<&DecoderSpec>,
    device: DeviceType,
) -> Result<Estimate, TrainError> {
    let size = |role| mesh.size(role) as f64;
    let (pp, dp, tp) = (
        size(AxisRole::Stages),
        size(AxisRole::Batch) * size(AxisRole::Experts),
        size(AxisRole::Heads),
    );
    let m = &cfg.model;
    let bytes = |d: DType| d.size() as f64;
    let s = bytes(m.dtype);
    // Activations in the dtype layers compute with (bf16 under --precision bf16-mixed).
    let a = bytes(cfg.precision(device)?.compute());
    // Token ids and labels: i64.
    let id = bytes(DType::I64);
    let batch = cfg.data.batch_size as f64;
    let accum = cfg.optim.grad_accum as f64;
    let zero = cfg.parallel.zero;
    let moments = match cfg.optim.optimizer {
        Opt::Adamw => 2.0,
        Opt::Sgd => 1.0,
    };
    Ok(match decoder {
        Some(d) => {
            let (c, l, h, t, v) = (
                d.cfg.width as f64,
                d.cfg.layers as f64,
                d.cfg.heads as f64,
                // This rank's tokens of each sequence (a context-parallel axis splits them).
                ceil_div(m.seq_len as f64, size(AxisRole::Sequence)),
                d.cfg.table_rows() as f64,
            );
            let n = d.arch.parameter_count(&d.cfg, d.cfg.table_rows()) as f64;
            let held = n / (pp * tp);
            // LoRA: only the adapters train (gradients, state); the frozen base is one copy
            // in the compute dtype.
            let trained = d.lora.as_ref().map_or(held, |l| {
                l.parameter_count(&d.cfg, &d.arch) as f64 / (pp * tp)
            });
            let shard = |from: u8| if zero >= from { trained / dp } else { trained };
            let r = ceil_div(batch, dp * cfg.parallel.micro_batches as f64 * accum);
            // Per token: what a block keeps for its backward pass (its input, two norms' outputs,
            // the attention output, q, k, v, the MLP's two 4C activations, and the fused
            // attention's log-sum-exp, one value of the compute dtype per own head), its MLP
            // part only under selective recomputation, its input only under full recomputation
            // (plus one block's set while it reruns), one 4C activation less under GELU
            // recomputation.
            let lse = (h / tp).max(1.0) * a.max(bytes(DType::F32)) / a;
            let block = 4.0 * c + 12.0 * c / tp + lse;
            let (kept, rerun) = match cfg.parallel.recompute {
                RecomputeArg::None => (block, 0.0),
                RecomputeArg::Selective => (2.0 * c + 8.0 * c / tp, block),
                RecomputeArg::Full => (c, block),
                // One 4C activation less where the MLP is one op (no tensor parallelism).
                RecomputeArg::Gelu if tp == 1.0 => (block - 4.0 * c, 0.0),
                RecomputeArg::Gelu => (block, 0.0),
            };
            // The logits and their softmax, split along the vocabulary over tp.
            let activations = a * r * t * (2.0 * v / tp + ceil_div(l, pp) * kept + rerun);
            // Under mixed precision a 16-bit copy of every held parameter is kept whole (or
            // gathered whole for the step, ZeRO-3), and ZeRO-1/2 keep f32 master shards.
            let (leaves, copies) = match a < s {
                true if zero >= 1 => (trained / dp, trained),
                true => (trained, trained),
                false => (shard(3), 0.0),
            };
            let frozen = a * (held - trained).max(0.0);
            let e = Estimate {
                parameters: s * leaves + a * copies + frozen,
                gradients: s * shard(2),
                optimizer_state: moments * s * shard(1),
                activations,
                batches: 2.0 * id * r * t,
            };
            if !cfg.run.eval_only {
                return Ok(e);
            }
            // An evaluation keeps no gradients, no optimizer state and nothing for a backward
            // pass: the parameters, one batch's logits and its token ids.
            let r = ceil_div(batch, dp);
            Estimate {
                gradients: 0.0,
                optimizer_state: 0.0,
                activations: a * r * t * 2.0 * v / tp,
                batches: 2.0 * id * r * t,
                ..e
            }
        }
        None => {
            let (f, hd, k) = (m.features as f64, m.hidden as f64, m.classes as f64);
            let held = (f * hd + hd + hd * k + k) / tp;
            let r = ceil_div(batch, dp);
            Estimate {
                parameters: s * held,
                gradients: s * held,
                optimizer_state: moments * s * held,
                // The input, the hidden layer before and after its ReLU, the logits and their
                // softmax.
                activations: a * r * (f + 2.0 * hd / tp + 2.0 * k),
                batches: 2.0 * id * r,
            }
        }
    })
}

/// Bytes as a person reads them (KiB, MiB, ... with 3 significant digits).
pub fn human(bytes: f64) -> String {
    const UNITS: [&str; 7] = ["B", "KiB", "MiB", "GiB", "TiB", "PiB", "EiB"];
    let mut v = bytes;
    let mut u = 0;
    while v >= 1024.0 && u + 1 < UNITS.len() {
        v /= 1024.0;
        u += 1;
    }
    if u == 0 {
        format!("{v:.0} B")
    } else if v >= 1e6 {
        format!("{v:.3e} {}", UNITS[u])
    } else {
        format!("{v:.3} {}", UNITS[u])
    }
}

fn read_bytes(path: &Path) -> Option<f64> {
    let text = std::fs::read_to_string(path).ok()?;
    text.trim().parse::<u64>().ok().map(|v| v as f64)
}

/// (limit, usage) of this process's memory cgroup, when it has a limit.
fn cgroup_room() -> Option<(f64, f64, PathBuf)> {
    let text = std::fs::read_to_string("/proc/self/cgroup").ok()?;
    for line in text.lines() {
        let mut parts = line.splitn(3, ':');
        let (_, controllers, path) = (parts.next()?, parts.next()?, parts.next()?);
        let rel = path.trim_start_matches('/');
        let (dirs, files) = if controllers.is_empty() {
            let root = Path::new("/sys/fs/cgroup");
            (
                [root.join(rel), root.to_path_buf()],
                ("memory.max", "memory.current"),
            )
        } else if controllers.split(',').any(|c| c == "memory") {
            let root = Path::new("/sys/fs/cgroup/memory");
            (
                [root.join(rel), root.to_path_buf()],
                ("memory.limit_in_bytes", "memory.usage_in_bytes"),
            )
        } else {
            continue;
        };
        for dir in dirs {
            let limit = dir.join(files.0);
            // "max" (v2) or a huge v1 value: no limit at this level.
            match read_bytes(&limit) {
                Some(l) if l < (1u64 << 60) as f64 => {
                    let used = read_bytes(&dir.join(files.1)).unwrap_or(0.0);
                    return Some((l, used, limit));
                }
                Some(_) => break,
                None if limit.exists() => break,
                None => continue,
            }
        }
    }
    None
}

/// The unit [`host_available`] rounds down to: ranks of one host read the figure moments
/// apart, and rounded they agree (a jitter of a few MiB crosses a multiple of it rarely), so
/// they refuse alike, with the same words.
const HOST_GRAIN: f64 = 256.0 * 1024.0 * 1024.0;

/// Bytes the host can still give, and where that figure comes from; None where nothing says.
/// What varies from moment to moment is rounded to [`HOST_GRAIN`] against the job: the
/// available memory down, the cgroup's use up.
pub fn host_available() -> Option<(f64, String)> {
    let meminfo = std::fs::read_to_string("/proc/meminfo").ok();
    let available = meminfo.as_deref().and_then(|t| {
        let line = t.lines().find(|l| l.starts_with("MemAvailable:"))?;
        let kib: f64 = line.split_whitespace().nth(1)?.parse().ok()?;
        Some((kib * 1024.0 / HOST_GRAIN).floor() * HOST_GRAIN)
    });
    let cgroup = cgroup_room().map(|(limit, used, path)| {
        let used = (used / HOST_GRAIN).ceil() * HOST_GRAIN;
        (
            (limit - used).max(0.0),
            format!(
                "the cgroup limit {} less {} in use ({})",
                human(limit),
                human(used),
                path.display()
            ),
        )
    });
    match (available, cgroup) {
        (Some(a), Some((c, why))) if c < a => Some((c, why)),
        (Some(a), _) => Some((a, "MemAvailable in /proc/meminfo".into())),
        (None, c) => c,
    }
}

/// What this process's address-space limit (`RLIMIT_AS`, `ulimit -v`) leaves of its own mapped
/// size (VmSize, rounded up to [`HOST_GRAIN`]), and where that figure comes from; None where no
/// limit is set.
pub fn address_space_room() -> Option<(f64, String)> {
    use nix::sys::resource::{getrlimit, Resource, RLIM_INFINITY};
    let (soft, _) = getrlimit(Resource::RLIMIT_AS).ok()?;
    if soft == RLIM_INFINITY {
        return None;
    }
    let limit = soft as f64;
    let status = std::fs::read_to_string("/proc/self/status").unwrap_or_default();
    let mapped = status
        .lines()
        .find(|l| l.starts_with("VmSize:"))
        .and_then(|l| l.split_whitespace().nth(1)?.parse::<f64>().ok())
        .map_or(0.0, |kib| (kib * 1024.0 / HOST_GRAIN).ceil() * HOST_GRAIN);
    Some((
        (limit - mapped).max(0.0),
        format!(
            "the address-space limit RLIMIT_AS (ulimit -v) {} less {} this process has mapped",
            human(limit),
            human(mapped)
        ),
    ))
}

/// The flags that size the largest part of `e`.
fn culprit(cfg: &TrainConfig, e: &Estimate) -> String {
    let m = &cfg.model;
    let b = cfg.data.batch_size;
    let state = e.parameters + e.gradients + e.optimizer_state;
    let sizes = match &m.from_hf {
        Some(dir) => format!("the model of --from-hf {}", dir.display()),
        None => format!("--layers {} and --width {}", m.layers, m.width),
    };
    match m.model {
        ModelKind::Gpt | ModelKind::Llama if state >= e.activations + e.batches => format!(
            "the parameters, gradients and optimizer state ({}) grow with {sizes} (and the vocabulary padded to --vocab-multiple {}, and --seq-len {})",
            human(state), m.vocab_multiple, m.seq_len
        ),
        ModelKind::Gpt | ModelKind::Llama => format!(
            "the activations and token ids ({}) grow with --batch-size {b}, --seq-len {}, {sizes} (and the vocabulary padded to --vocab-multiple {})",
            human(e.activations + e.batches), m.seq_len, m.vocab_multiple
        ),
        ModelKind::Mlp if state >= e.activations + e.batches => format!(
            "the parameters, gradients and optimizer state ({}) grow with --hidden {}, --features {} and --classes {}",
            human(state), m.hidden, m.features, m.classes
        ),
        ModelKind::Mlp => format!(
            "the activations and labels ({}) grow with --batch-size {b} (and --features {}, --hidden {})",
            human(e.activations + e.batches), m.features, m.hidden
        ),
    }
}

fn refuse(
    cfg: &TrainConfig,
    e: &Estimate,
    need: f64,
    per: &str,
    have: f64,
    source: &str,
) -> TrainError {
    TrainError::Memory {
        detail: format!(
            "this job needs at least {} of {per} but {} is available ({source}): {}; per rank at least parameters {}, gradients {}, optimizer state {}, activations {}, token ids {} (README: the memory estimate)",
            human(need),
            human(have),
            culprit(cfg, e),
            human(e.parameters),
            human(e.gradients),
            human(e.optimizer_state),
            human(e.activations),
            human(e.batches),
        ),
    }
}

/// Refuses `cfg` on `mesh` when `local_ranks` ranks' host parts do not fit in the host's
/// available memory: every part on the CPU, the token ids on a GPU, and only those while the
/// device is not known yet (`device` None: before the world starts).
pub fn check_host(
    cfg: &TrainConfig,
    mesh: &MeshLayout,
    decoder: Option<&DecoderSpec>,
    device: Option<DeviceType>,
    local_ranks: usize,
) -> Result<Estimate, TrainError> {
    let e = estimate(cfg, mesh, decoder, device.unwrap_or(DeviceType::Cuda))?;
    let on_host = match device {
        Some(DeviceType::Cpu) => e.total(),
        _ => e.batches,
    };
    let need = on_host * local_ranks.max(1) as f64;
    if let Some((have, source)) = host_available() {
        if need > have {
            let per = format!("host memory for {local_ranks} rank(s) on this host");
            return Err(refuse(cfg, &e, need, &per, have, &source));
        }
    }
    if let Some((have, source)) = address_space_room() {
        if on_host > have {
            return Err(refuse(
                cfg,
                &e,
                on_host,
                "address space for this rank",
                have,
                &source,
            ));
        }
    }
    Ok(e)
}

/// `check_host` on `device`, and on a GPU one rank's model against its device's free memory.
pub fn check(
    cfg: &TrainConfig,
    mesh: &MeshLayout,
    decoder: Option<&DecoderSpec>,
    device: DeviceType,
    local_ranks: usize,
) -> Result<Estimate, TrainError> {
    let e = check_host(cfg, mesh, decoder, Some(device), local_ranks)?;
    if device == DeviceType::Cuda {
        if let Some(rt) = oxiflow_cuda::bound_runtime() {
            let (free, _) = rt.memory_info()?;
            let have = (free + rt.cached_bytes()) as f64;
            if e.model() > have {
                let source = format!("free on CUDA device {}", rt.ordinal());
                return Err(refuse(cfg, &e, e.model(), "device memory", have, &source));
            }
        }
    }
    Ok(e)
}
