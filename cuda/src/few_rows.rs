//! Products of one to sixteen rows (`few_rows.cu`, compiled once per process): a bf16 or f16
//! `[m, k]` times a weight stored `[k, n]` (`nn`) or `[n, k]` (`nt`, used transposed), the
//! shape of every product of a decoding step. A tiled product spends most of its tile on rows
//! that do not exist there; these kernels read the weight once at the memory's rate and keep
//! every row's sums in registers (f32, rounded once). [`few_row_product`] takes the products it
//! serves and leaves the rest to cuBLAS; `OXIFLOW_FEW_ROW_PRODUCTS=0` leaves all to cuBLAS
//! (for measuring one against the other).

use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::OnceLock;

use cudarc::driver::LaunchConfig;
use oxiflow_dtype::DType;

use super::library_sources::FEW_ROW_PRODUCTS;
use super::nvrtc_module::{launch_fn, module, Module};
use super::precision::Gemm;
use super::raw::FResult;
use super::storage::CudaStorage;
use super::CudaRuntime;

static MODULE: OnceLock<Result<Module, String>> = OnceLock::new();
/// Products these kernels ran in this process.
static LAUNCHES: AtomicU64 = AtomicU64::new(0);

/// How many products the few-row kernels have run in this process (what shows that a product
/// took them).
pub fn few_row_launches() -> u64 {
    LAUNCHES.load(Ordering::Relaxed)
}

/// Threads per block (`FR_THREADS`) and warps per block.
const THREADS: usize = 512;
const WARPS: usize = THREADS / 32;
/// The most rows a product may have here.
pub(crate) const MAX_ROWS: usize = 16;
/// The row counts the source is instantiated for (a product takes the first at least its own).
const ROW_TILES: [usize; 5] = [1, 2, 4, 8, 16];

/// The kernels' names, by dtype (bf16, f16), layout (`nn`, `nt`) and row tile.
const NAMES: [[[&str; 5]; 2]; 2] = [
    [
        [
            "few_rows_nn_bf16_1",
            "few_rows_nn_bf16_2",
            "few_rows_nn_bf16_4",
            "few_rows_nn_bf16_8",
            "few_rows_nn_bf16_16",
        ],
        [
            "few_rows_nt_bf16_1",
            "few_rows_nt_bf16_2",
            "few_rows_nt_bf16_4",
            "few_rows_nt_bf16_8",
            "few_rows_nt_bf16_16",
        ],
    ],
    [
        [
            "few_rows_nn_f16_1",
            "few_rows_nn_f16_2",
            "few_rows_nn_f16_4",
            "few_rows_nn_f16_8",
            "few_rows_nn_f16_16",
        ],
        [
            "few_rows_nt_f16_1",
            "few_rows_nt_f16_2",
            "few_rows_nt_f16_4",
            "few_rows_nt_f16_8",
            "few_rows_nt_f16_16",
        ],
    ],
];

fn kernels(rt: &CudaRuntime, op: &'static str) -> FResult<&'static Module> {
    module(&MODULE, rt.context(), op, &FEW_ROW_PRODUCTS, || {
        NAMES
            .iter()
            .flatten()
            .flatten()
            .map(|s| s.to_string())
            .collect()
    })
}

/// Builds the module now (from `init::start_background_builds`).
pub(crate) fn build_module(rt: &CudaRuntime) {
    // A failure is kept in the module's cell and reported by the first product that needs it.
    let _ = kernels(rt, "background kernel build");
}

/// Whether products may take these kernels (`OXIFLOW_FEW_ROW_PRODUCTS`, read once; on
/// unless it is `0`).
fn enabled() -> bool {
    static ON: OnceLock<bool> = OnceLock::new();
    *ON.get_or_init(|| std::env::var("OXIFLOW_FEW_ROW_PRODUCTS").map_or(true, |v| v != "0"))
}

/// Whether [`few_row_product`] serves `g` on pieces of `dtype` at device addresses `a` and `b`:
/// one 16-bit product of 1 to [`MAX_ROWS`] rows of an untransposed `a`, every size nonzero, n
/// and k multiples of 8 and both operands 16-byte aligned (the kernels' vector loads).
pub(crate) fn serves(g: &Gemm, dtype: DType, a: u64, b: u64) -> bool {
    matches!(dtype, DType::BF16 | DType::F16)
        && g.batch == 1
        && !g.ta
        && (1..=MAX_ROWS).contains(&g.m)
        && g.n > 0
        && g.k > 0
        && g.n % 8 == 0
        && g.k % 8 == 0
        && g.n <= i32::MAX as usize
        && g.k <= i32::MAX as usize
        && (a | b) % 16 == 0
        && enabled()
}

/// Runs `g` (which [`serves`] accepts) on packed pieces `a` `[m, k]`, `b` (`[k, n]`, or
/// `[n, k]` with `tb`) into `out` `[m, n]` on the compute stream; `Ok(false)`, nothing run,
/// where it does not serve `g`.
pub(crate) fn few_row_product(
    rt: &std::sync::Arc<CudaRuntime>,
    op: &'static str,
    a: &CudaStorage,
    b: &CudaStorage,
    out: &CudaStorage,
    g: &Gemm,
) -> FResult<bool> {
    let (ap, bp, yp) = (a.ptr(), b.ptr(), out.ptr());
    let packed = a.numel() == g.m * g.k && b.numel() == g.k * g.n && out.numel() == g.m * g.n;
    if !packed || !serves(g, a.dtype, ap, bp) || b.dtype != a.dtype || out.dtype != a.dtype {
        return Ok(false);
    }
    let tile = ROW_TILES.iter().position(|&t| t >= g.m).unwrap_or(4);
    let by_dtype = usize::from(a.dtype == DType::F16);
    let f = kernels(rt, op)?.get(op, NAMES[by_dtype][usize::from(g.tb)][tile])?;
    // nn: a block per 2 x COLS columns (COLS 8, or 4 at 16 rows); nt: a warp per 2 columns.
    let blocks = if g.tb {
        g.n.div_ceil(2 * WARPS)
    } else {
        g.n.div_ceil(if ROW_TILES[tile] == MAX_ROWS { 8 } else { 16 })
    };
    let cfg = LaunchConfig {
        grid_dim: (blocks as u32, 1, 1),
        block_dim: (THREADS as u32, 1, 1),
        shared_mem_bytes: 0,
    };
    let (rows, k, n) = (g.m as i32, g.k as i64, g.n as i64);
    launch_fn!(rt, op, f, cfg; ap, bp, yp, rows, k, n)?;
    LAUNCHES.fetch_add(1, Ordering::Relaxed);
    Ok(true)
}
