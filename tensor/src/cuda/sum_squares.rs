//! The multi-tensor sum of squares of the raw layer (`sum_squares.cu`, compiled once per
//! process): every tensor of a list summed in f64 in two launches, the per-tensor sums and
//! their total written to f64 device arrays, in a fixed order (the same bits on every run).

use std::sync::{Arc, OnceLock};

use cudarc::driver::{DeviceRepr, LaunchConfig};

use super::nvrtc_module::{launch_fn, module, Module};
use super::raw::{invalid, FResult};
use super::storage::upload;
use super::{Block, CudaRuntime};

const SOURCE: &str = concat!(
    include_str!("device_types.cuh"),
    include_str!("sum_squares.cu")
);
static MODULE: OnceLock<Result<Module, String>> = OnceLock::new();
/// Threads per block of `sum_squares_blocks` (`SUM_THREADS`).
const THREADS: usize = 256;
/// Most blocks per tensor, and elements per thread before another block is added.
const MAX_BLOCKS: usize = 128;
const PER_THREAD: usize = 8;
/// Most tensors in one launch (the grid's y extent).
const MAX_TENSORS: usize = 65535;

fn kernels(rt: &CudaRuntime, op: &'static str) -> FResult<&'static Module> {
    module(&MODULE, rt, op, SOURCE, || {
        vec!["sum_squares_blocks".into(), "sum_squares_finish".into()]
    })
}

/// The element type of one summed tensor (`SumEntry::dtype`).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) enum SumElem {
    F32 = 0,
    Bf16 = 1,
    F16 = 2,
    F64 = 3,
}

/// One summed tensor (`struct SumEntry`): `n` contiguous elements at `ptr`.
#[repr(C)]
#[derive(Clone, Copy, Debug)]
pub(crate) struct SumEntry {
    pub ptr: u64,
    pub n: i64,
    pub dtype: i32,
    pub pad: i32,
}
// SAFETY: plain old data with the C layout of `struct SumEntry`.
unsafe impl DeviceRepr for SumEntry {}

impl SumEntry {
    pub(crate) fn new(ptr: u64, n: usize, elem: SumElem) -> SumEntry {
        SumEntry {
            ptr,
            n: n as i64,
            dtype: elem as i32,
            pad: 0,
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
    let most = list.iter().map(|e| e.n as usize).max().unwrap_or(0);
    let blocks = most.div_ceil(THREADS * PER_THREAD).clamp(1, MAX_BLOCKS);
    let partial = Block::alloc(rt, list.len() * blocks * 8)?;
    let entries = Block::alloc(rt, std::mem::size_of_val(list))?;
    // SAFETY: SumEntry is repr(C) plain old data; the bytes are its exact representation.
    let raw = unsafe {
        std::slice::from_raw_parts(list.as_ptr().cast::<u8>(), std::mem::size_of_val(list))
    };
    upload(rt, entries.ptr(), raw, op)?;
    let zeroed = i32::from(zeroed);
    for (c, chunk) in list.chunks(MAX_TENSORS).enumerate() {
        let first = c * MAX_TENSORS;
        let cfg = LaunchConfig {
            grid_dim: (blocks as u32, chunk.len() as u32, 1),
            block_dim: (THREADS as u32, 1, 1),
            shared_mem_bytes: 0,
        };
        let lp = entries.ptr() + (first * std::mem::size_of::<SumEntry>()) as u64;
        let pp = partial.ptr() + (first * blocks * 8) as u64;
        launch_fn!(rt, op, fb, cfg; lp, zeroed, pp)?;
    }
    let cfg = LaunchConfig {
        grid_dim: (1, 1, 1),
        block_dim: (THREADS as u32, 1, 1),
        shared_mem_bytes: 0,
    };
    let (pp, nb, nt) = (partial.ptr(), blocks as i32, list.len() as i32);
    launch_fn!(rt, op, ff, cfg; pp, nb, nt, each, total)
}
