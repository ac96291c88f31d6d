//! The fused NVRTC kernels of the raw layer (`fused.cu`, compiled once per process): residual
//! add + LayerNorm forward and backward, the single-launch multi-tensor AdamW, the fused
//! classifier (one read of each row where it fits the registers and shared memory of a block,
//! else two), and 16-byte vectorised element-wise kernels. Operands are device addresses of
//! contiguous row-major arrays of the given `FloatType`; statistics and optimizer state are f32.

use std::sync::{Arc, OnceLock};

use cudarc::driver::sys::CUdevice_attribute;
use cudarc::driver::{DeviceRepr, LaunchConfig};

use super::library_sources::FUSED;
use super::nvrtc_module::{launch_fn, module, Module};
use super::raw::{aligned, invalid, Classifier, FResult, FloatType, FusedError, SMEM_BYTES};
use super::storage::upload;
use super::{Block, CudaRuntime};

mod one_read;
pub(crate) use one_read::build_one_read_module;
use one_read::{classifier_smem_limit, forced_plan, one_read_fn, resident_blocks, row_plan};
pub use one_read::{row_plan_occupancy, RowPlan};

static MODULE: OnceLock<Result<Module, String>> = OnceLock::new();

fn kernels(rt: &CudaRuntime, op: &'static str) -> FResult<&'static Module> {
    module(&MODULE, rt.context(), op, &FUSED, || {
        let mut v = vec!["adamw_multi".to_string()];
        for t in FloatType::ALL {
            for k in [
                "ln_fwd",
                "ln_bwd",
                "ln_bwd_reduce",
                "classifier",
                "row_scale",
                "ew",
            ] {
                v.push(format!("{k}_{}", t.suffix()));
            }
            for w in WARP_ROW_VECTORS {
                v.push(format!("ln_fwd_warp{w}_{}", t.suffix()));
                v.push(format!("ln_bwd_warp{w}_{}", t.suffix()));
            }
        }
        v
    })
}

/// The LayerNorm forward with one warp per row is built for rows of at most `32 * V` 16-byte
/// vectors for each V here (the row stays in the warp's registers).
const WARP_ROW_VECTORS: [usize; 6] = [1, 2, 3, 4, 6, 8];
/// Rows of a warp-per-row block.
const WARPS_PER_BLOCK: usize = 8;
/// Blocks per multiprocessor of the warp-per-row LayerNorm backward: its warps keep their
/// columns' sums in registers across rows, so fewer blocks mean fewer partial sums to reduce.
const LN_BWD_WARP_BLOCKS_PER_SM: usize = 2;

/// The smallest built V of the warp-per-row kernel for rows of `cols` elements of `t` (16-byte
/// vectors), if the row fits one.
fn warp_row_vectors(cols: usize, t: FloatType) -> Option<usize> {
    let per = 16 / t.size();
    if !cols.is_multiple_of(per) {
        return None;
    }
    let need = (cols / per).div_ceil(32);
    WARP_ROW_VECTORS.into_iter().find(|&v| v >= need)
}

/// The device's multiprocessors (read once per process).
fn sm_count(rt: &CudaRuntime) -> usize {
    static SMS: OnceLock<usize> = OnceLock::new();
    *SMS.get_or_init(|| {
        rt.context()
            .attribute(CUdevice_attribute::CU_DEVICE_ATTRIBUTE_MULTIPROCESSOR_COUNT)
            .map(|n| n.max(1) as usize)
            .unwrap_or(132)
    })
}

/// Blocks for a row-per-block kernel: every row once, at most a few waves of the device.
fn row_blocks(rt: &CudaRuntime, rows: usize) -> usize {
    rows.clamp(1, sm_count(rt) * 8)
}

fn opt(p: Option<u64>) -> u64 {
    p.unwrap_or(0)
}

/// `r = x + residual` (when given; written to `sum_out` when given) and `y = LayerNorm(r)` over
/// the last dim of `[rows, cols]`, saving each row's mean and reciprocal standard deviation
/// (f32 `[rows]`). `x`, `residual`, `weight`, `bias`, `sum_out`, `y` are of `dtype`.
#[derive(Clone, Copy, Debug)]
pub struct LayerNormForward {
    pub rows: usize,
    pub cols: usize,
    pub eps: f32,
    pub dtype: FloatType,
    pub x: u64,
    pub residual: Option<u64>,
    pub weight: u64,
    pub bias: u64,
    pub sum_out: Option<u64>,
    pub y: u64,
    pub mean: u64,
    pub rstd: u64,
}

/// A LayerNorm pass's shape: some rows, 1 to `i32::MAX` columns, and a row at `col_bytes` a
/// column fitting shared memory (else `Unsupported`).
fn check_rows(op: &'static str, rows: usize, cols: usize, col_bytes: usize) -> FResult<()> {
    if rows == 0 || cols == 0 || cols > i32::MAX as usize {
        return Err(invalid(op, format!("shape [{rows}, {cols}]")));
    }
    if cols * col_bytes > SMEM_BYTES {
        return Err(FusedError::Unsupported {
            op,
            detail: format!(
                "rows of {cols} columns (at most {})",
                SMEM_BYTES / col_bytes
            ),
        });
    }
    Ok(())
}

pub fn layer_norm_forward(rt: &Arc<CudaRuntime>, a: &LayerNormForward) -> FResult<()> {
    let op = "fused layer norm";
    check_rows(op, a.rows, a.cols, 4)?;
    if a.sum_out.is_some() && a.residual.is_none() {
        return Err(invalid(
            op,
            "a residual sum output without a residual input",
        ));
    }
    if [a.x, a.weight, a.bias, a.y, a.mean, a.rstd].contains(&0) {
        return Err(invalid(op, "null device address"));
    }
    let n = a.dtype.suffix();
    let m = kernels(rt, op)?;
    let per_vec = 16 / a.dtype.size();
    let all = [a.x, opt(a.residual), a.weight, a.bias, opt(a.sum_out), a.y];
    let (rows, cols, eps) = (a.rows as i64, a.cols as i32, a.eps);
    let (res, sum) = (opt(a.residual), opt(a.sum_out));
    if let (Some(v), true) = (warp_row_vectors(a.cols, a.dtype), aligned(&all)) {
        let f = m.get(op, &format!("ln_fwd_warp{v}_{n}"))?;
        let cfg = LaunchConfig {
            grid_dim: (a.rows.div_ceil(WARPS_PER_BLOCK).min(1 << 20) as u32, 1, 1),
            block_dim: ((32 * WARPS_PER_BLOCK) as u32, 1, 1),
            shared_mem_bytes: 0,
        };
        return launch_fn!(rt, op, f, cfg; rows, cols, eps, a.x, res, a.weight, a.bias, sum, a.y, a.mean, a.rstd);
    }
    let f = m.get(op, &format!("ln_fwd_{n}"))?;
    let vec = (a.cols.is_multiple_of(per_vec) && aligned(&all)) as i32;
    let cfg = LaunchConfig {
        grid_dim: (row_blocks(rt, a.rows) as u32, 1, 1),
        block_dim: (
            a.cols.div_ceil(per_vec).next_multiple_of(32).clamp(32, 256) as u32,
            1,
            1,
        ),
        shared_mem_bytes: (a.cols * 4) as u32,
    };
    launch_fn!(rt, op, f, cfg; rows, cols, eps, vec, a.x, res, a.weight, a.bias, sum, a.y, a.mean, a.rstd)
}

/// The LayerNorm backward: `dr = LN'(dy) + residual_grad` (of `dtype`) from the forward's
/// input `r` and saved statistics; `dweight = sum dy xhat` and `dbias = sum dy` (`[cols]` of
/// `grad_type`, summed in f32 and added to the existing values when `accumulate`), reduced in a
/// fixed order (deterministic). Rows that fit a warp's registers (at most 32 elements a lane,
/// 16-byte aligned) take one warp a row, whose columns' sums stay in registers across its rows
/// (`ln_bwd_warp`); others one block a row (`ln_bwd`).
#[derive(Clone, Copy, Debug)]
pub struct LayerNormBackward {
    pub rows: usize,
    pub cols: usize,
    pub dtype: FloatType,
    pub dy: u64,
    pub r: u64,
    pub mean: u64,
    pub rstd: u64,
    pub weight: u64,
    pub residual_grad: Option<u64>,
    pub dr: u64,
    pub dweight: u64,
    pub dbias: u64,
    pub grad_type: FloatType,
    pub accumulate: bool,
}

pub fn layer_norm_backward(rt: &Arc<CudaRuntime>, a: &LayerNormBackward) -> FResult<()> {
    let op = "fused layer norm backward";
    check_rows(op, a.rows, a.cols, 8)?;
    if [
        a.dy, a.r, a.mean, a.rstd, a.weight, a.dr, a.dweight, a.dbias,
    ]
    .contains(&0)
    {
        return Err(invalid(op, "null device address"));
    }
    let n = a.dtype.suffix();
    let m = kernels(rt, op)?;
    let dres = opt(a.residual_grad);
    let all = [a.dy, a.r, a.weight, dres, a.dr];
    // One warp per row where the row fits a lane's registers (at most 32 elements a lane).
    let warp = warp_row_vectors(a.cols, a.dtype)
        .filter(|v| v * 16 / a.dtype.size() <= 32 && aligned(&all));
    let (name, groups, block) = match warp {
        Some(v) => (
            format!("ln_bwd_warp{v}_{n}"),
            a.rows
                .div_ceil(WARPS_PER_BLOCK)
                .min(sm_count(rt) * LN_BWD_WARP_BLOCKS_PER_SM),
            32 * WARPS_PER_BLOCK,
        ),
        None => (
            format!("ln_bwd_{n}"),
            row_blocks(rt, a.rows).min(528),
            a.cols.next_multiple_of(32).clamp(32, 256),
        ),
    };
    let parts = Block::alloc(rt, 2 * groups * a.cols * 4)?;
    let pw = parts.ptr();
    let pb = pw + (groups * a.cols * 4) as u64;
    let f = m.get(op, &name)?;
    let cfg = LaunchConfig {
        grid_dim: (groups as u32, 1, 1),
        block_dim: (block as u32, 1, 1),
        shared_mem_bytes: (a.cols * 8) as u32,
    };
    let (rows, cols) = (a.rows as i64, a.cols as i32);
    launch_fn!(rt, op, f, cfg; rows, cols, a.dy, a.r, a.mean, a.rstd, a.weight, dres, a.dr, pw, pb)?;
    let f = m.get(op, &format!("ln_bwd_reduce_{}", a.grad_type.suffix()))?;
    let cfg = LaunchConfig {
        grid_dim: (a.cols.div_ceil(32) as u32, 1, 1),
        block_dim: (32, 16, 1),
        shared_mem_bytes: 0,
    };
    let (g, acc) = (groups as i32, a.accumulate as i32);
    launch_fn!(rt, op, f, cfg; g, cols, acc, pw, pb, a.dweight, a.dbias)
}

/// One tensor of the multi-tensor AdamW (`struct AdamTensor` of the source): f32 master
/// `param`, f32 `m` and `v` (zeros before the first step), the gradient (f32, or bf16 with
/// `grad_bf16`), where the new values go (`param_out`, `m_out`, `v_out`: the inputs themselves
/// to update in place), and an optional bf16 copy of the updated parameter.
#[repr(C)]
#[derive(Clone, Copy, Debug, Default)]
pub struct AdamTensor {
    pub param: u64,
    pub grad: u64,
    pub m: u64,
    pub v: u64,
    pub param_out: u64,
    pub m_out: u64,
    pub v_out: u64,
    /// 0: no bf16 copy.
    pub param_bf16: u64,
    pub n: i64,
    /// `1 - lr weight_decay`, rounded to f32 (see [`AdamHyper::decay`]).
    pub decay: f32,
    pub grad_bf16: i32,
}
// SAFETY: plain old data with the C layout of `struct AdamTensor`.
unsafe impl DeviceRepr for AdamTensor {}

/// The step's coefficients (`struct AdamCoef`), each computed in f64 and rounded to f32 as
/// `AdamW::step` and the `adam` kernels do.
#[repr(C)]
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct AdamCoef {
    a1: f32,
    b1: f32,
    a2: f32,
    b2: f32,
    step: f32,
    inv_bc2: f32,
    eps: f32,
    grad_scale: f32,
    /// The unclipped `b1` and `b2` in f64, for a device clip ratio.
    b1d: f64,
    b2d: f64,
    /// Address of a device f64 clip ratio r: every gradient is scaled by min(r, 1) (0: none).
    clip_ratio: u64,
    /// Non-zero: a NaN r leaves every tensor as it was.
    skip_nan: i32,
}
// SAFETY: plain old data with the C layout of `struct AdamCoef`.
unsafe impl DeviceRepr for AdamCoef {}

impl AdamCoef {
    /// The coefficients `[a1, b1, a2, b2, step, inv_bc2, eps]` (see the kernel) rounded to f32,
    /// with gradients taken as they are (any clip factor folded into `b1` and `b2`).
    pub fn new(c: [f64; 7]) -> AdamCoef {
        let [a1, b1, a2, b2, step, inv_bc2, eps] = c.map(|x| x as f32);
        AdamCoef {
            a1,
            b1,
            a2,
            b2,
            step,
            inv_bc2,
            eps,
            grad_scale: 1.0,
            b1d: c[1],
            b2d: c[3],
            clip_ratio: 0,
            skip_nan: 0,
        }
    }

    /// These coefficients with every gradient scaled by `min(r, 1)`, r the device f64 at
    /// `clip_ratio` (`b1` and `b2` unclipped here): the kernel folds it in as the host does.
    pub fn clipped_by(self, clip_ratio: u64) -> AdamCoef {
        AdamCoef { clip_ratio, ..self }
    }

    /// These coefficients with a NaN clip ratio leaving every tensor as it was (the outputs
    /// get the inputs' values) instead of a NaN update.
    pub fn skipping_nan(self) -> AdamCoef {
        AdamCoef {
            skip_nan: 1,
            ..self
        }
    }
}

/// AdamW's hyper-parameters for step `t` (1 for the first step).
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct AdamHyper {
    pub lr: f64,
    pub beta1: f64,
    pub beta2: f64,
    pub eps: f64,
    pub t: i32,
    /// Multiplies every gradient first (global-norm clipping); 1 leaves them unchanged.
    pub grad_scale: f32,
}

impl AdamHyper {
    pub fn coef(&self) -> AdamCoef {
        let (bc1, bc2) = (1.0 - self.beta1.powi(self.t), 1.0 - self.beta2.powi(self.t));
        AdamCoef {
            a1: self.beta1 as f32,
            b1: (1.0 - self.beta1) as f32,
            a2: self.beta2 as f32,
            b2: (1.0 - self.beta2) as f32,
            step: (self.lr / bc1) as f32,
            inv_bc2: (1.0 / bc2) as f32,
            eps: self.eps as f32,
            grad_scale: self.grad_scale,
            b1d: 1.0 - self.beta1,
            b2d: 1.0 - self.beta2,
            clip_ratio: 0,
            skip_nan: 0,
        }
    }
    /// A tensor's decay factor for weight decay `wd`.
    pub fn decay(&self, wd: f64) -> f32 {
        (1.0 - self.lr * wd) as f32
    }
}

/// One AdamW step over every tensor of `tensors` in a single launch, with coefficients `coef`
/// (`AdamHyper::coef`, or `AdamCoef::new`).
pub fn adamw_multi(rt: &Arc<CudaRuntime>, tensors: &[AdamTensor], coef: &AdamCoef) -> FResult<()> {
    let op = "fused adamw";
    if tensors.is_empty() {
        return Ok(());
    }
    if tensors.len() > 65535 {
        return Err(invalid(
            op,
            format!("{} tensors in one launch (at most 65535)", tensors.len()),
        ));
    }
    if let Some(t) = tensors.iter().find(|t| {
        t.n < 0 || [t.param, t.grad, t.m, t.v, t.param_out, t.m_out, t.v_out].contains(&0)
    }) {
        return Err(invalid(op, format!("tensor {t:?}")));
    }
    let m = kernels(rt, op)?;
    let f = m.get(op, "adamw_multi")?;
    let bytes = std::mem::size_of_val(tensors);
    let list = Block::alloc(rt, bytes)?;
    // SAFETY: AdamTensor is repr(C) plain old data; the bytes are its exact representation.
    let raw = unsafe { std::slice::from_raw_parts(tensors.as_ptr().cast::<u8>(), bytes) };
    upload(rt, list.ptr(), raw, op)?;
    let most = tensors.iter().map(|t| t.n as usize).max().unwrap_or(1);
    let cfg = LaunchConfig {
        grid_dim: (
            most.div_ceil(256 * 4).clamp(1, 1024) as u32,
            tensors.len() as u32,
            1,
        ),
        block_dim: (256, 1, 1),
        shared_mem_bytes: 0,
    };
    let (lp, k) = (list.ptr(), *coef);
    launch_fn!(rt, op, f, cfg; lp, k)
}

/// Which kernel `classifier_using` launches.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum ClassifierKernel {
    /// The one-read kernel of [`classifier_plan`] where the row fits it, else the two-pass one.
    Auto,
    /// The two-pass kernel (the row read twice).
    TwoPass,
    /// The one-read kernel with `v` vectors a thread in blocks of `block` threads (an error
    /// where it cannot run).
    OneRead { v: usize, block: usize },
}

/// The one-read launch `classifier_using` makes for `a` with `kernel` (None: the two-pass
/// kernel). `Auto` takes [`row_plan`] where the logits and the gradient are 16-byte aligned.
pub fn classifier_plan(
    rt: &CudaRuntime,
    a: &Classifier,
    kernel: ClassifierKernel,
) -> FResult<Option<RowPlan>> {
    let dx = a.dlogits.unwrap_or(a.logits);
    match kernel {
        ClassifierKernel::Auto if aligned(&[a.logits, dx]) => {
            Ok(row_plan(a.ld, a.dtype, classifier_smem_limit(rt)?))
        }
        ClassifierKernel::Auto => Ok(None),
        ClassifierKernel::TwoPass => Ok(None),
        ClassifierKernel::OneRead { v, block } => forced_plan(rt, a, v, block).map(Some),
    }
}

/// Launches the fused classifier `a`: one read of each row where [`row_plan`] finds a launch
/// for it, else the two-pass kernel.
pub fn classifier(rt: &Arc<CudaRuntime>, a: &Classifier) -> FResult<()> {
    classifier_using(rt, a, ClassifierKernel::Auto)
}

/// `classifier` with the kernel chosen by the caller (the kernel check compares them).
pub fn classifier_using(
    rt: &Arc<CudaRuntime>,
    a: &Classifier,
    kernel: ClassifierKernel,
) -> FResult<()> {
    let op = "fused classifier";
    if a.rows == 0 || a.v == 0 || a.ld < a.v || a.ld > i32::MAX as usize {
        return Err(invalid(
            op,
            format!("{} rows of {} logits (stride {})", a.rows, a.v, a.ld),
        ));
    }
    if [a.logits, a.targets, a.loss].contains(&0) {
        return Err(invalid(op, "null device address"));
    }
    let (rows, v, ld) = (a.rows as i64, a.v as i32, a.ld as i32);
    let dx = a.dlogits.unwrap_or(a.logits);
    let strict = a.strict as i32;
    if let Some(p) = classifier_plan(rt, a, kernel)? {
        let f = one_read_fn(rt, &p, a.dtype)?;
        rt.bind(op)?;
        // As many blocks as fit on the device at once, each looping over its rows.
        let per_sm = resident_blocks(f, &p, a.dtype);
        let cfg = LaunchConfig {
            grid_dim: (a.rows.min(sm_count(rt) * per_sm) as u32, 1, 1),
            block_dim: (p.block as u32, 1, 1),
            shared_mem_bytes: p.smem as u32,
        };
        return launch_fn!(rt, op, f, cfg; rows, v, ld, a.dloss, strict, a.logits, dx, a.targets, a.loss);
    }
    let f = kernels(rt, op)?.get(op, &format!("classifier_{}", a.dtype.suffix()))?;
    let cfg = LaunchConfig {
        grid_dim: (row_blocks(rt, a.rows) as u32, 1, 1),
        block_dim: (512, 1, 1),
        shared_mem_bytes: 0,
    };
    let vec = (a.ld.is_multiple_of(16 / a.dtype.size()) && aligned(&[a.logits, dx])) as i32;
    launch_fn!(rt, op, f, cfg; rows, v, ld, a.dloss, vec, strict, a.logits, dx, a.targets, a.loss)
}

/// `y[r, j] = x[r, j] scale[r]` over `rows` rows of `cols` values of `dtype` (`scale` f32
/// `[rows]`), computed in f32 and rounded once: a per-row loss gradient applied to the saved
/// logits' gradient.
#[derive(Clone, Copy, Debug)]
pub struct RowScale {
    pub rows: usize,
    pub cols: usize,
    pub dtype: FloatType,
    pub x: u64,
    pub scale: u64,
    pub y: u64,
}

pub fn row_scale(rt: &Arc<CudaRuntime>, a: &RowScale) -> FResult<()> {
    let op = "fused row scale";
    if a.rows == 0 || a.cols == 0 {
        return Ok(());
    }
    if a.cols > i32::MAX as usize {
        return Err(invalid(op, format!("rows of {} columns", a.cols)));
    }
    if [a.x, a.scale, a.y].contains(&0) {
        return Err(invalid(op, "null device address"));
    }
    let m = kernels(rt, op)?;
    let f = m.get(op, &format!("row_scale_{}", a.dtype.suffix()))?;
    let per = 16 / a.dtype.size();
    let vec = (a.cols.is_multiple_of(per) && aligned(&[a.x, a.y])) as i32;
    let work = if vec == 1 {
        a.rows * a.cols / per
    } else {
        a.rows * a.cols
    };
    let cfg = LaunchConfig {
        grid_dim: (work.div_ceil(256).clamp(1, 65535 * 4) as u32, 1, 1),
        block_dim: (256, 1, 1),
        shared_mem_bytes: 0,
    };
    let (rows, cols) = (a.rows as i64, a.cols as i32);
    launch_fn!(rt, op, f, cfg; rows, cols, vec, a.x, a.scale, a.y)
}

/// The element-wise functions of `elementwise`.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum EwOp {
    /// `y = a + b`
    Add,
    /// `y = a b`
    Mul,
    /// `y = a c`
    Scale,
    /// `y = gelu(a)` (tanh form)
    Gelu,
    /// `y = a gelu'(b)` (a = dy, b = x)
    GeluBackward,
}

impl EwOp {
    fn code(self) -> i32 {
        match self {
            EwOp::Add => 0,
            EwOp::Mul => 1,
            EwOp::Scale => 2,
            EwOp::Gelu => 3,
            EwOp::GeluBackward => 4,
        }
    }
    pub(crate) fn binary(self) -> bool {
        matches!(self, EwOp::Add | EwOp::Mul | EwOp::GeluBackward)
    }
}

/// `y = op(a[, b][, c])` over `n` elements of `dtype`, 16 bytes per access when every address
/// is 16-byte aligned (`b` is 0 for the one-operand functions).
#[derive(Clone, Copy, Debug)]
pub struct Elementwise {
    pub op: EwOp,
    pub dtype: FloatType,
    pub n: usize,
    pub a: u64,
    pub b: u64,
    pub c: f32,
    pub y: u64,
}

pub fn elementwise(rt: &Arc<CudaRuntime>, e: &Elementwise) -> FResult<()> {
    let op = "fused elementwise";
    if e.n == 0 {
        return Ok(());
    }
    if e.a == 0 || e.y == 0 || (e.op.binary() && e.b == 0) {
        return Err(invalid(op, "null device address"));
    }
    let m = kernels(rt, op)?;
    let f = m.get(op, &format!("ew_{}", e.dtype.suffix()))?;
    let per = 16 / e.dtype.size();
    let vec = aligned(&[e.a, e.b, e.y]) as i32;
    let work = if vec == 1 { e.n / per + e.n % per } else { e.n };
    let cfg = LaunchConfig {
        grid_dim: (work.div_ceil(256).clamp(1, 65535 * 4) as u32, 1, 1),
        block_dim: (256, 1, 1),
        shared_mem_bytes: 0,
    };
    let (nn, code) = (e.n as i64, e.op.code());
    launch_fn!(rt, op, f, cfg; nn, code, e.c, vec, e.a, e.b, e.y)
}

/// Builds the fused module now (from `build_times::start_background_builds`).
pub(crate) fn build_module(rt: &CudaRuntime) {
    // A failure is kept in the module's cell and reported by the first op that needs it.
    let _ = kernels(rt, "background kernel build");
}
