//! The multi-range copy of the raw layer (`copy_many.cu`, compiled once per process): many
//! contiguous byte ranges copied in one launch (a concatenation of row-major pieces along
//! their leading dim, e.g. a gradient bucket's flat buffer), 16 bytes at a time where every
//! address and length allows. Each range gets blocks in proportion to its size (one per
//! 64 KiB, 1 to 1024), all in one grid.

use std::sync::OnceLock;

use cudarc::driver::{DeviceRepr, LaunchConfig};

use super::library_sources::COPY_MANY;
use super::nvrtc_module::{launch_fn, module, Module};
use super::raw::{invalid, FResult};
use super::storage::upload;
use super::{Block, CudaRuntime};

static MODULE: OnceLock<Result<Module, String>> = OnceLock::new();
/// Threads per block of `copy_many` (`COPY_THREADS`).
const THREADS: usize = 256;
/// Most blocks per range, and bytes per block before another block is added.
const MAX_BLOCKS: usize = 1024;
const PER_BLOCK: usize = 64 << 10;

fn kernels(rt: &CudaRuntime, op: &'static str) -> FResult<&'static Module> {
    module(&MODULE, rt.context(), op, &COPY_MANY, || {
        vec!["copy_many".into()]
    })
}

/// Builds the module now (from `build_times::start_background_builds`).
pub(crate) fn build_module(rt: &CudaRuntime) {
    // A failure is kept in the module's cell and reported by the first op that needs it.
    let _ = kernels(rt, "background kernel build");
}

/// One copied range (`struct CopyEntry`): `bytes` bytes from `src` to `dst`, moved by
/// `blocks` blocks from block `first` of the grid (set by [`copy_many`]).
#[repr(C)]
#[derive(Clone, Copy, Debug)]
pub(crate) struct CopyEntry {
    pub src: u64,
    pub dst: u64,
    pub bytes: i64,
    pub first: i64,
    pub blocks: i32,
    pub pad: i32,
}
// SAFETY: plain old data with the C layout of `struct CopyEntry`.
unsafe impl DeviceRepr for CopyEntry {}

impl CopyEntry {
    pub(crate) fn new(src: u64, dst: u64, bytes: usize) -> CopyEntry {
        CopyEntry {
            src,
            dst,
            bytes: bytes as i64,
            first: 0,
            blocks: 1,
            pad: 0,
        }
    }
}

/// Queues the copy of every range of `list` (ranges of zero bytes are skipped; source and
/// destination ranges must not overlap) on the compute stream.
pub(crate) fn copy_many(rt: &std::sync::Arc<CudaRuntime>, list: &[CopyEntry]) -> FResult<()> {
    let op = "multi-range copy";
    let mut list: Vec<CopyEntry> = list.iter().copied().filter(|e| e.bytes != 0).collect();
    if list.is_empty() {
        return Ok(());
    }
    if let Some(e) = list
        .iter()
        .find(|e| e.bytes < 0 || e.src == 0 || e.dst == 0)
    {
        return Err(invalid(op, format!("range {e:?}")));
    }
    if list.len() > i32::MAX as usize {
        return Err(invalid(op, format!("{} ranges", list.len())));
    }
    let mut grid = 0usize;
    for e in &mut list {
        let blocks = (e.bytes as usize).div_ceil(PER_BLOCK).clamp(1, MAX_BLOCKS);
        (e.blocks, e.first) = (blocks as i32, grid as i64);
        grid += blocks;
    }
    if grid > i32::MAX as usize {
        return Err(invalid(op, format!("{grid} blocks")));
    }
    let f = kernels(rt, op)?.get(op, "copy_many")?;
    let entries = Block::alloc(rt, std::mem::size_of_val(list.as_slice()))?;
    upload(rt, entries.ptr(), &list, op)?;
    let (lp, n) = (entries.ptr(), list.len() as i32);
    let cfg = LaunchConfig {
        grid_dim: (grid as u32, 1, 1),
        block_dim: (THREADS as u32, 1, 1),
        shared_mem_bytes: 0,
    };
    launch_fn!(rt, op, f, cfg; lp, n)
}
