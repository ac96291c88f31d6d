//! The multi-tensor sum of squares of the raw layer (`sum_squares.cu`, compiled once per
//! process): every tensor of a list summed in f64 in two launches, the per-tensor sums and
//! their total written to f64 device arrays, in a fixed order (the same bits on every run).
//! Each tensor gets blocks in proportion to its size (one per 4096 elements, 1 to 1024), all
//! in one grid.

use std::sync::{Arc, OnceLock};

use cudarc::driver::{DeviceRepr, LaunchConfig};

use super::library_sources::SUM_SQUARES;
use super::nvrtc_module::{launch_fn, module, Module};
use super::raw::{invalid, FResult};
use super::storage::upload;
use super::{Block, CudaRuntime};

static MODULE: OnceLock<Result<Module, String>> = OnceLock::new();
/// Threads per block of `sum_squares_blocks` (`SUM_THREADS`).
const THREADS: usize = 256;
/// Most blocks per tensor, and elements per thread before another block is added.
const MAX_BLOCKS: usize = 1024;
const PER_THREAD: usize = 16;

fn kernels(rt: &CudaRuntime, op: &'static str) -> FResult<&'static Module> {
    module(&MODULE, rt, op, &SUM_SQUARES, || {
        vec!["sum_squares_blocks".into(), "sum_squares_finish".into()]
    })
}

/// Builds the module now (from `build_times::start_background_builds`).
pub(crate) fn build_module(rt: &CudaRuntime) {
    // A failure is kept in the module's cell and reported by the first op that needs it.
    let _ = kernels(rt, "background kernel build");
}

/// The element type of one summed tensor (`SumEntry::dtype`).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) enum SumElem {
    F32 = 0,
    Bf16 = 1,
    F16 = 2,
    F64 = 3,
}

/// One summed tensor (`struct SumEntry`): `n` contiguous elements at `ptr`, summed by
/// `blocks` blocks from block `first` of the grid (set by [`sum_squares`]).
#[repr(C)]
#[derive(Clone, Copy, Debug)]
pub(crate) struct SumEntry {
    pub ptr: u64,
    pub n: i64,
    pub dtype: i32,
    pub blocks: i32,
    pub first: i64,
}
// SAFETY: plain old data with the C layout of `struct SumEntry`.
unsafe impl DeviceRepr for SumEntry {}

impl SumEntry {
    pub(crate) fn new(ptr: u64, n: usize, elem: SumElem) -> SumEntry {
        SumEntry {
            ptr,
            n: n as i64,
            dtype: elem as i32,
            blocks: 1,
            first: 0,
        }
    }
}

/// Sums `x * x` (`zeroed`: `x * 0`) over each tensor of `list` into `each` (f64, one per
/// tensor) and their total into `total` (one f64).
pub(crate) fn sum_squares(
    rt: &Arc<CudaRuntime>,
    list: &[SumEntry],
    zeroed: bool,
    each: u64,
    total: u64,
) -> FResult<()> {
    let op = "sum of squares";
    if list.is_empty() || list.len() > i32::MAX as usize {
        return Err(invalid(op, format!("{} tensors", list.len())));
    }
    if let Some(e) = list.iter().find(|e| e.n < 0 || (e.n > 0 && e.ptr == 0)) {
        return Err(invalid(op, format!("tensor {e:?}")));
    }
    if each == 0 || total == 0 {
        return Err(invalid(op, "no output buffers"));
    }
    let m = kernels(rt, op)?;
    let (fb, ff) = (
        m.get(op, "sum_squares_blocks")?,
        m.get(op, "sum_squares_finish")?,
    );
    let mut list = list.to_vec();
    let mut grid = 0usize;
    for e in &mut list {
        let blocks = (e.n as usize)
            .div_ceil(THREADS * PER_THREAD)
            .clamp(1, MAX_BLOCKS);
        (e.blocks, e.first) = (blocks as i32, grid as i64);
        grid += blocks;
    }
    if grid > i32::MAX as usize {
        return Err(invalid(op, format!("{grid} blocks")));
    }
    let partial = Block::alloc(rt, grid * 8)?;
    let entries = Block::alloc(rt, std::mem::size_of_val(list.as_slice()))?;
    upload(rt, entries.ptr(), &list, op)?;
    let (lp, nt, zeroed, pp) = (
        entries.ptr(),
        list.len() as i32,
        i32::from(zeroed),
        partial.ptr(),
    );
    let cfg = LaunchConfig {
        grid_dim: (grid as u32, 1, 1),
        block_dim: (THREADS as u32, 1, 1),
        shared_mem_bytes: 0,
    };
    launch_fn!(rt, op, fb, cfg; lp, nt, zeroed, pp)?;
    let cfg = LaunchConfig {
        grid_dim: (1, 1, 1),
        block_dim: (THREADS as u32, 1, 1),
        shared_mem_bytes: 0,
    };
    launch_fn!(rt, op, ff, cfg; lp, nt, pp, each, total)
}
