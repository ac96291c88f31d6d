//! Matrix products through cuBLASLt with fused epilogues, row-major like `precision::Gemm`:
//! `out[i] = alpha op(a[i]) op(b[i]) + beta out[i]` (β = 1 accumulates, e.g. weight gradients)
//! followed by an epilogue: a bias broadcast over rows, GELU (tanh form, as the tensor crate's
//! `gelu`) of the biased product saving the pre-activation for backward, the GELU backward
//! from that saved pre-activation, or a bias gradient (column sums of `op(a)` or rows sums of
//! `op(b)` over k) written beside the product. bf16/f16 inputs accumulate in f32; f32 inputs
//! run in f32 or on TF32 tensor cores. The bias, bias gradient and pre-activation have the
//! output's type.
//!
//! Row-major `out = op(a) op(b)` is column-major `out^T = op(b)^T op(a)^T`: cuBLASLt's A is our
//! b, its B our a, its rows our columns. Descriptors, layouts and the heuristic's algorithm are
//! cached per shape, types and epilogue; the workspace comes from the runtime's allocator.

use std::collections::hash_map::Entry;
use std::collections::HashMap;
use std::ffi::c_void;
use std::sync::{Arc, Mutex};

use cudarc::cublas::sys::cublasOperation_t;
use cudarc::cublaslt::result as lt;
use cudarc::cublaslt::sys::{
    self, cublasComputeType_t, cublasLtEpilogue_t as Ep,
    cublasLtMatmulDescAttributes_t as DescAttr, cublasLtMatmulPreferenceAttributes_t as PrefAttr,
    cublasLtMatrixLayoutAttribute_t as LayoutAttr, cudaDataType,
};
use oxiflow_collectives::cuda_libs::{self, LibSearch};

use super::raw::{invalid, FResult, FloatType, FusedError};
use super::{Block, CudaRuntime};

/// What follows the product.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum Epilogue {
    None,
    /// `out += bias[col]` (`bias`: `n` values).
    Bias {
        bias: u64,
    },
    /// `pre = product + bias[col]` is written to `pre` (`[m, n]`, the output's type) and
    /// `out = gelu(pre)`.
    GeluAuxBias {
        bias: u64,
        pre: u64,
    },
    /// `out = product * gelu'(pre)` with `pre` from `GeluAuxBias`.
    DGelu {
        pre: u64,
    },
    /// `DGelu`, and `bias_grad[col] = sum over rows of out` (`n` values).
    DGeluBiasGrad {
        pre: u64,
        bias_grad: u64,
    },
    /// `bias_grad[i] = sum_k op(a)[i, k]` (`m` values): the bias gradient of a weight gradient
    /// `dW = dY^T X` with `a = dY` (cuBLASLt's BGRADB).
    BiasGradRows {
        bias_grad: u64,
    },
    /// `bias_grad[j] = sum_k op(b)[k, j]` (`n` values) (cuBLASLt's BGRADA).
    BiasGradCols {
        bias_grad: u64,
    },
}

impl Epilogue {
    fn code(self) -> Ep {
        match self {
            Epilogue::None => Ep::CUBLASLT_EPILOGUE_DEFAULT,
            Epilogue::Bias { .. } => Ep::CUBLASLT_EPILOGUE_BIAS,
            Epilogue::GeluAuxBias { .. } => Ep::CUBLASLT_EPILOGUE_GELU_AUX_BIAS,
            Epilogue::DGelu { .. } => Ep::CUBLASLT_EPILOGUE_DGELU,
            Epilogue::DGeluBiasGrad { .. } => Ep::CUBLASLT_EPILOGUE_DGELU_BGRAD,
            Epilogue::BiasGradRows { .. } => Ep::CUBLASLT_EPILOGUE_BGRADB,
            Epilogue::BiasGradCols { .. } => Ep::CUBLASLT_EPILOGUE_BGRADA,
        }
    }
    /// (bias or bias-gradient address, pre-activation address).
    fn pointers(self) -> (u64, u64) {
        match self {
            Epilogue::None => (0, 0),
            Epilogue::Bias { bias } => (bias, 0),
            Epilogue::GeluAuxBias { bias, pre } => (bias, pre),
            Epilogue::DGelu { pre } => (0, pre),
            Epilogue::DGeluBiasGrad { pre, bias_grad } => (bias_grad, pre),
            Epilogue::BiasGradRows { bias_grad } | Epilogue::BiasGradCols { bias_grad } => {
                (bias_grad, 0)
            }
        }
    }
}

/// One (batched) product: `a` stored `[m, k]` (`[k, m]` with `ta`), `b` stored `[k, n]`
/// (`[n, k]` with `tb`), `out` `[m, n]`, all row-major and contiguous within a batch entry;
/// strides in elements between batch entries (0: shared).
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct LtMatmul {
    pub batch: usize,
    pub m: usize,
    pub n: usize,
    pub k: usize,
    pub ta: bool,
    pub tb: bool,
    pub strides: (i64, i64, i64),
    pub in_type: FloatType,
    pub out_type: FloatType,
    /// f32 inputs on TF32 tensor cores.
    pub tf32: bool,
    pub alpha: f32,
    /// 0 overwrites `out`, 1 accumulates into it.
    pub beta: f32,
    pub epilogue: Epilogue,
}

impl LtMatmul {
    /// One unbatched product `[m, k] @ [k, n]` (`ta`/`tb`: operand stored transposed) of
    /// types `t` (inputs, and TF32 for f32 inputs) into an output of the inputs' type,
    /// overwriting it, with no epilogue; callers change what differs.
    pub fn new(
        (m, n, k): (usize, usize, usize),
        (ta, tb): (bool, bool),
        t: (FloatType, bool),
    ) -> LtMatmul {
        LtMatmul {
            batch: 1,
            m,
            n,
            k,
            ta,
            tb,
            strides: (0, 0, 0),
            in_type: t.0,
            out_type: t.0,
            tf32: t.1,
            alpha: 1.0,
            beta: 0.0,
            epilogue: Epilogue::None,
        }
    }
}

fn data_type(t: FloatType) -> cudaDataType {
    match t {
        FloatType::F32 => cudaDataType::CUDA_R_32F,
        FloatType::Bf16 => cudaDataType::CUDA_R_16BF,
        FloatType::F16 => cudaDataType::CUDA_R_16F,
    }
}

#[derive(Clone, Debug, PartialEq, Eq, Hash)]
struct Key {
    dims: [usize; 4],
    trans: (bool, bool),
    strides: (i64, i64, i64),
    types: (FloatType, FloatType, bool),
    epilogue: u32,
    beta_zero: bool,
    /// Whether every address is 16-byte aligned (the heuristic's algorithms assume it).
    aligned: bool,
}

impl Key {
    /// The key of product `g` on addresses that are all 16-byte aligned or not (`aligned`).
    fn of(g: &LtMatmul, aligned: bool) -> Key {
        Key {
            dims: [g.batch, g.m, g.n, g.k],
            trans: (g.ta, g.tb),
            strides: g.strides,
            types: (g.in_type, g.out_type, g.tf32),
            epilogue: g.epilogue.code() as u32,
            beta_zero: g.beta == 0.0,
            aligned,
        }
    }
}

/// Cached descriptors and algorithm of one key.
struct Cached {
    desc: sys::cublasLtMatmulDesc_t,
    a: sys::cublasLtMatrixLayout_t,
    b: sys::cublasLtMatrixLayout_t,
    c: sys::cublasLtMatrixLayout_t,
    algo: sys::cublasLtMatmulAlgo_t,
    workspace: usize,
}

struct State {
    handle: sys::cublasLtHandle_t,
    cache: HashMap<Key, Cached>,
}

// SAFETY: the handle and descriptors are used only under the STATE mutex; cuBLASLt handles
// and descriptors may move between threads when calls do not overlap.
unsafe impl Send for State {}

static STATE: Mutex<Option<State>> = Mutex::new(None);

/// Workspace offered to the heuristic (cuBLASLt's recommendation for Hopper).
const MAX_WORKSPACE: usize = 32 << 20;

fn lt_err(op: &'static str, what: &str, e: impl std::fmt::Display) -> FusedError {
    FusedError::Refused {
        op,
        lib: "cuBLASLt",
        what: what.to_string(),
        detail: e.to_string(),
    }
}

fn layout(
    op: &'static str,
    t: FloatType,
    rows: usize,
    cols: usize,
    batch: usize,
    stride: i64,
) -> FResult<sys::cublasLtMatrixLayout_t> {
    // Column-major rows x cols with leading dimension rows.
    let l = lt::create_matrix_layout(data_type(t), rows as u64, cols as u64, rows as i64)
        .map_err(|e| lt_err(op, "a matrix layout", e))?;
    if batch > 1 {
        let count = batch as i32;
        // SAFETY: l is live; the attribute values have the documented types (int32, int64).
        unsafe {
            lt::set_matrix_layout_attribute(
                l,
                LayoutAttr::CUBLASLT_MATRIX_LAYOUT_BATCH_COUNT,
                (&count as *const i32).cast(),
                4,
            )
            .and_then(|_| {
                lt::set_matrix_layout_attribute(
                    l,
                    LayoutAttr::CUBLASLT_MATRIX_LAYOUT_STRIDED_BATCH_OFFSET,
                    (&stride as *const i64).cast(),
                    8,
                )
            })
        }
        .map_err(|e| lt_err(op, "a batched layout", e))?;
    }
    Ok(l)
}

fn set_desc<T>(
    op: &'static str,
    d: sys::cublasLtMatmulDesc_t,
    attr: DescAttr,
    v: &T,
) -> FResult<()> {
    // SAFETY: d is live; v has the attribute's documented type and size.
    unsafe {
        lt::set_matmul_desc_attribute(d, attr, (v as *const T).cast(), std::mem::size_of::<T>())
    }
    .map_err(|e| lt_err(op, &format!("attribute {attr:?}"), e))
}

/// The operation flag as the int32 the descriptor attribute takes.
fn flag(t: bool) -> i32 {
    if t {
        cublasOperation_t::CUBLAS_OP_T as i32
    } else {
        cublasOperation_t::CUBLAS_OP_N as i32
    }
}

fn build(op: &'static str, handle: sys::cublasLtHandle_t, g: &LtMatmul) -> FResult<Cached> {
    let compute = match (g.in_type, g.tf32) {
        (FloatType::F32, true) => cublasComputeType_t::CUBLAS_COMPUTE_32F_FAST_TF32,
        _ => cublasComputeType_t::CUBLAS_COMPUTE_32F,
    };
    let desc = lt::create_matmul_desc(compute, cudaDataType::CUDA_R_32F)
        .map_err(|e| lt_err(op, "a matmul descriptor", e))?;
    // cuBLASLt's A is our b (n x k column-major, or k x n transposed), its B our a.
    set_desc(op, desc, DescAttr::CUBLASLT_MATMUL_DESC_TRANSA, &flag(g.tb))?;
    set_desc(op, desc, DescAttr::CUBLASLT_MATMUL_DESC_TRANSB, &flag(g.ta))?;
    set_desc(
        op,
        desc,
        DescAttr::CUBLASLT_MATMUL_DESC_EPILOGUE,
        &(g.epilogue.code() as u32),
    )?;
    let (_, pre) = g.epilogue.pointers();
    if pre != 0 {
        let ld = g.n as i64;
        set_desc(
            op,
            desc,
            DescAttr::CUBLASLT_MATMUL_DESC_EPILOGUE_AUX_LD,
            &ld,
        )?;
        if g.batch > 1 {
            let stride = (g.m * g.n) as i64;
            set_desc(
                op,
                desc,
                DescAttr::CUBLASLT_MATMUL_DESC_EPILOGUE_AUX_BATCH_STRIDE,
                &stride,
            )?;
        }
    }
    let (sa, sb, sc) = g.strides;
    let (arows, acols) = if g.tb { (g.k, g.n) } else { (g.n, g.k) };
    let (brows, bcols) = if g.ta { (g.m, g.k) } else { (g.k, g.m) };
    let a = layout(op, g.in_type, arows, acols, g.batch, sb)?;
    let b = layout(op, g.in_type, brows, bcols, g.batch, sa)?;
    let c = layout(op, g.out_type, g.n, g.m, g.batch, sc)?;
    let pref = lt::create_matmul_pref().map_err(|e| lt_err(op, "a preference", e))?;
    let ws = MAX_WORKSPACE as u64;
    // SAFETY: pref is live; the attribute is a uint64.
    let heur = unsafe {
        lt::set_matmul_pref_attribute(
            pref,
            PrefAttr::CUBLASLT_MATMUL_PREF_MAX_WORKSPACE_BYTES,
            (&ws as *const u64).cast(),
            8,
        )
        .and_then(|_| lt::get_matmul_algo_heuristic(handle, desc, a, b, c, c, pref))
    };
    // SAFETY: pref is live and not used again.
    unsafe { lt::destroy_matmul_pref(pref) }.ok();
    let heur = heur.map_err(|e| lt_err(op, &format!("{g:?}"), e))?;
    Ok(Cached {
        desc,
        a,
        b,
        c,
        algo: heur.algo,
        workspace: heur.workspaceSize,
    })
}

/// The process's handle (created on first use) and the plan of `key` (product `g`), cached in
/// `st`, built on a miss.
fn plan_in<'s>(
    op: &'static str,
    st: &'s mut Option<State>,
    key: Key,
    g: &LtMatmul,
) -> FResult<(sys::cublasLtHandle_t, &'s Cached)> {
    if st.is_none() {
        let handle = lt::create_handle().map_err(|e| FusedError::Unavailable {
            op,
            lib: "cuBLASLt",
            detail: format!("creating a handle: {e}"),
        })?;
        *st = Some(State {
            handle,
            cache: HashMap::new(),
        });
    }
    let Some(state) = st.as_mut() else {
        return Err(invalid(op, "no cuBLASLt state"));
    };
    let plan = match state.cache.entry(key) {
        Entry::Occupied(e) => e.into_mut(),
        Entry::Vacant(e) => e.insert(build(op, state.handle, g)?),
    };
    Ok((state.handle, plan))
}

/// Creates the process's cuBLASLt handle and plans one small bf16 product, so the first
/// product an op runs does not pay for cuBLASLt's start-up (its heuristics' first query).
/// Run on a start-up background thread; a failure is left for the first op to meet and report.
pub(crate) fn start_up(rt: &CudaRuntime) {
    let op = "cublaslt start-up";
    if cuda_libs::ensure_cublas(&LibSearch::default()).is_err() || rt.bind(op).is_err() {
        return;
    }
    let g = LtMatmul::new((128, 128, 128), (false, false), (FloatType::Bf16, false));
    let start = std::time::Instant::now();
    let mut st = STATE.lock().unwrap_or_else(|p| p.into_inner());
    if plan_in(op, &mut st, Key::of(&g, true), &g).is_ok() {
        super::build_times::record_compiled("cuBLASLt handle and first plan", start);
    }
}

fn check(op: &'static str, g: &LtMatmul, ptrs: &[u64]) -> FResult<()> {
    let dims = [g.batch, g.m, g.n, g.k];
    if dims.contains(&0) || dims.iter().any(|&d| d > i32::MAX as usize) {
        return Err(invalid(op, format!("sizes {dims:?}")));
    }
    if g.in_type == FloatType::F32 && g.out_type != FloatType::F32 {
        return Err(FusedError::Unsupported {
            op,
            detail: format!("f32 inputs with a {:?} output", g.out_type),
        });
    }
    if g.tf32 && g.in_type != FloatType::F32 {
        return Err(invalid(op, "TF32 applies to f32 inputs only"));
    }
    if ptrs.contains(&0) {
        return Err(invalid(op, "null device address"));
    }
    let (bias, pre) = g.epilogue.pointers();
    if matches!(
        g.epilogue,
        Epilogue::GeluAuxBias { .. } | Epilogue::DGelu { .. } | Epilogue::DGeluBiasGrad { .. }
    ) && (pre == 0 || !g.n.is_multiple_of(8))
    {
        return Err(FusedError::Unsupported {
            op,
            detail: format!(
                "GELU epilogues need a pre-activation buffer and n a multiple of 8 (n = {})",
                g.n
            ),
        });
    }
    if g.epilogue != Epilogue::None && bias == 0 && pre == 0 {
        return Err(invalid(op, "null epilogue address"));
    }
    Ok(())
}

/// Runs `g` with `a`, `b`, `out` device addresses on the runtime's compute stream (`out` is
/// also the C operand a nonzero `beta` reads).
pub fn lt_matmul(rt: &Arc<CudaRuntime>, g: &LtMatmul, a: u64, b: u64, out: u64) -> FResult<()> {
    lt_matmul_c(rt, g, a, b, out, out)
}

/// [`lt_matmul`] reading the C operand (`beta c`, laid out as `out`) from `c`.
pub(crate) fn lt_matmul_c(
    rt: &Arc<CudaRuntime>,
    g: &LtMatmul,
    a: u64,
    b: u64,
    c_in: u64,
    out: u64,
) -> FResult<()> {
    let op = "cublaslt matmul";
    check(op, g, &[a, b, c_in, out])?;
    cuda_libs::ensure_cublas(&LibSearch::default()).map_err(|e| FusedError::Unavailable {
        op,
        lib: "cuBLASLt",
        detail: e.to_string(),
    })?;
    let (bias, pre) = g.epilogue.pointers();
    let aligned = [a, b, c_in, out, bias, pre].iter().all(|p| p % 16 == 0);
    let key = Key::of(g, aligned);
    rt.bind(op)?;
    let mut st = STATE.lock().unwrap_or_else(|p| p.into_inner());
    let (handle, plan) = plan_in(op, &mut st, key, g)?;
    if bias != 0 {
        set_desc(
            op,
            plan.desc,
            DescAttr::CUBLASLT_MATMUL_DESC_BIAS_POINTER,
            &bias,
        )?;
    }
    if pre != 0 {
        set_desc(
            op,
            plan.desc,
            DescAttr::CUBLASLT_MATMUL_DESC_EPILOGUE_AUX_POINTER,
            &pre,
        )?;
    }
    let ws = Block::alloc(rt, plan.workspace.max(1))?;
    let (alpha, beta) = (g.alpha, g.beta);
    // SAFETY: descriptors and layouts are live and describe a, b and out, which are device
    // allocations of at least the sizes those layouts address; alpha and beta are f32 (the
    // scale type) and outlive the call; the workspace holds plan.workspace bytes.
    unsafe {
        lt::matmul(
            handle,
            plan.desc,
            (&alpha as *const f32).cast(),
            (&beta as *const f32).cast(),
            b as *const c_void,
            plan.a,
            a as *const c_void,
            plan.b,
            c_in as *const c_void,
            plan.c,
            out as *mut c_void,
            plan.c,
            &plan.algo,
            ws.ptr() as *mut c_void,
            plan.workspace,
            rt.stream().cu_stream() as sys::cudaStream_t,
        )
    }
    .map_err(|e| FusedError::Tensor(super::derr(op, format!("cublasLtMatmul ({g:?}): {e}"))))
}
