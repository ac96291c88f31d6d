//! The CUDA kernel (`sum_squares.cu`, through the library's NVRTC path): every input summed in
//! f64 in two launches, the per-tensor sums and their total written to the executor's f64
//! buffers, in a fixed order (the same bits on every run). Each tensor gets blocks in
//! proportion to its size (one per 4096 elements, 1 to 1024), all in one grid; the grid's
//! partial sums and the uploaded tensor list are scratch buffers the executor allocates.

use cudarc::driver::{DeviceRepr, LaunchConfig, PushKernelArg};
use oxiflow_cuda::{device_error, launched, CudaKernels, CudaSource, KernelIds};
use oxiflow_dtype::DType;
use oxiflow_sbp::Shape;
use oxiflow_tensor::{ExternOp, KernelIo, OutSpec, Result};

use super::{SumSquares, SumTerm};

/// Threads per block of `sum_squares_blocks` (`SUM_THREADS`).
const THREADS: usize = 256;
/// Most blocks per tensor, and elements per thread before another block is added.
const MAX_BLOCKS: usize = 1024;
const PER_THREAD: usize = 16;

/// The kernels of `sum_squares.cu`.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum SumKernel {
    Blocks,
    Finish,
}

impl KernelIds for SumKernel {
    const ALL: &'static [Self] = &[SumKernel::Blocks, SumKernel::Finish];
    fn entry(self) -> &'static str {
        match self {
            SumKernel::Blocks => "sum_squares_blocks",
            SumKernel::Finish => "sum_squares_finish",
        }
    }
}

static SOURCE: CudaSource<SumKernel> = CudaSource::new(
    "multi-tensor sum of squares",
    include_str!("sum_squares.cu"),
);

/// One summed tensor (`struct SumEntry`): `n` contiguous elements at `ptr` of element code
/// `dtype`, summed by `blocks` blocks from block `first` of the grid.
#[repr(C)]
#[derive(Clone, Copy, Debug)]
struct SumEntry {
    ptr: u64,
    n: i64,
    dtype: i32,
    blocks: i32,
    first: i64,
}
// SAFETY: plain old data with the C layout of `struct SumEntry`.
unsafe impl DeviceRepr for SumEntry {}

/// i64 words one `SumEntry` takes in the scratch list.
const ENTRY_WORDS: usize = std::mem::size_of::<SumEntry>() / 8;

/// Blocks the grid gives a tensor of `n` elements.
fn blocks(n: usize) -> usize {
    n.div_ceil(THREADS * PER_THREAD).clamp(1, MAX_BLOCKS)
}

/// The scratch of a call on inputs of `ins`: the grid's partial sums (f64, one per block) and
/// the tensor list (i64 words, `ENTRY_WORDS` per tensor).
pub(super) fn scratch(_op: &SumSquares, ins: &[OutSpec], _outs: &[OutSpec]) -> Vec<OutSpec> {
    let grid: usize = ins.iter().map(|s| blocks(s.shape.numel())).sum();
    vec![
        OutSpec {
            shape: Shape::from(&[grid][..]),
            dtype: DType::F64,
        },
        OutSpec {
            shape: Shape::from(&[ins.len() * ENTRY_WORDS][..]),
            dtype: DType::I64,
        },
    ]
}

pub(super) fn sum_squares(
    op: &SumSquares,
    b: &CudaKernels,
    io: KernelIo<'_, CudaKernels>,
) -> Result<()> {
    let name = op.name();
    let mut list = Vec::with_capacity(io.inputs.len());
    let mut grid = 0usize;
    for (i, p) in io.inputs.iter().enumerate() {
        let code = match p.dtype() {
            DType::F32 => 0,
            DType::BF16 => 1,
            DType::F16 => 2,
            DType::F64 => 3,
            d => {
                return Err(device_error(
                    name,
                    format!("input {i} is {d}, not a float dtype"),
                ))
            }
        };
        let n = p.numel();
        let k = blocks(n);
        list.push(SumEntry {
            ptr: if n == 0 { 0 } else { p.ptr() },
            n: n as i64,
            dtype: code,
            blocks: k as i32,
            first: grid as i64,
        });
        grid += k;
    }
    let ([each, total], [partial, entries]) = (&*io.outputs, &*io.scratch) else {
        return Err(device_error(
            name,
            format!(
                "expects 2 outputs and 2 scratch buffers, got {} and {}",
                io.outputs.len(),
                io.scratch.len()
            ),
        ));
    };
    let f64s = each.dtype() == DType::F64 && total.dtype() == DType::F64;
    if !f64s || each.numel() != list.len() || total.numel() != 1 {
        return Err(device_error(
            name,
            format!(
                "{} inputs need f64 outputs [{}] and [], got {} {} and {} {}",
                list.len(),
                list.len(),
                each.dtype(),
                each.shape(),
                total.dtype(),
                total.shape()
            ),
        ));
    }
    if list.is_empty() || grid > i32::MAX as usize || partial.numel() != grid {
        return Err(device_error(
            name,
            format!(
                "{} tensors in {grid} blocks, {} partials",
                list.len(),
                partial.numel()
            ),
        ));
    }
    entries.write_from_host(name, &list)?;
    let rt = b.runtime();
    let (lp, nt, zeroed, pp) = (
        entries.ptr(),
        list.len() as i32,
        i32::from(op.term == SumTerm::TimesZero),
        partial.ptr(),
    );
    let (ep, tp) = (each.ptr(), total.ptr());
    let f = SOURCE.function(rt, name, SumKernel::Blocks)?;
    let mut l = rt.launcher(name, f)?;
    l.arg(&lp).arg(&nt).arg(&zeroed).arg(&pp);
    let cfg = LaunchConfig {
        grid_dim: (grid as u32, 1, 1),
        block_dim: (THREADS as u32, 1, 1),
        shared_mem_bytes: 0,
    };
    // SAFETY: sum_squares_blocks takes (const SumEntry*, int, int, double*): the list holds
    // `nt` entries whose pointers cover `n` elements of their dtype each, and `partial` one
    // f64 per block of the grid (checked above); the pieces outlive the launch.
    launched(name, unsafe { l.launch(cfg) })?;
    let f = SOURCE.function(rt, name, SumKernel::Finish)?;
    let mut l = rt.launcher(name, f)?;
    l.arg(&lp).arg(&nt).arg(&pp).arg(&ep).arg(&tp);
    let cfg = LaunchConfig {
        grid_dim: (1, 1, 1),
        block_dim: (THREADS as u32, 1, 1),
        shared_mem_bytes: 0,
    };
    // SAFETY: sum_squares_finish takes (const SumEntry*, int, const double*, double*,
    // double*): `each` holds `nt` f64s and `total` one (checked above).
    launched(name, unsafe { l.launch(cfg) })
}
