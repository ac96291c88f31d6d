//! Strided copies and fills on the device: `copy_nd` moves (or reduces) a box between two
//! strided layouts, through the row kernel (16-byte moves, a series of boxes in one launch)
//! whenever the box has contiguous runs, which covers every pack and unpack of boxing; `fill`
//! sets a buffer to one value.

use oxiflow_dtype::{bf16, f16, DType, Element};

use super::kernels::{grid, launch, rows_grid, Kernel, Nd, Template};
use super::{derr, CudaRuntime};
use oxiflow_tensor::Result;

/// Copies box `shape` from `src` (offset, strides) to `dst` (offset, strides); `op` 0 copies,
/// 1/2/3 reduce into dst (sum/max/min).
#[allow(clippy::too_many_arguments)]
pub fn copy_nd(
    rt: &CudaRuntime,
    opname: &'static str,
    dtype: DType,
    shape: &[usize],
    src: u64,
    src_off: usize,
    src_strides: &[i64],
    dst: u64,
    dst_off: usize,
    dst_strides: &[i64],
    op: i32,
) -> Result<()> {
    let n: usize = shape.iter().product();
    if n == 0 {
        return Ok(());
    }
    let p = Nd::new(shape, src_strides, dst_strides).ok_or_else(|| {
        derr(
            opname,
            format!("box {shape:?} has more than 8 non-contiguous dims"),
        )
    })?;
    // Boxes of at most two outer dims over contiguous runs (every boxing pack and unpack of a
    // split dim, one launch for a series of equal boxes) take the row kernel: no per-element
    // index division, 16-byte moves for copies.
    let nd = p.ndim as usize;
    if nd <= 3 && (nd == 0 || (p.s0[nd - 1] == 1 && p.s1[nd - 1] == 1)) {
        // (extent, src stride, dst stride) of batch, rows, run: missing outer dims are 1.
        let mut dims = [(1i64, 0i64, 0i64); 3];
        for i in 0..nd {
            dims[3 - nd + i] = (p.shape[i], p.s0[i], p.s1[i]);
        }
        let [(batch, bs, bd), (rows, ss, ds), (run, _, _)] = dims;
        return copy_rows(
            rt,
            opname,
            dtype,
            [batch, rows, run],
            (src, src_off as i64, bs, ss),
            (dst, dst_off as i64, bd, ds),
            op,
        );
    }
    // Four dims over contiguous runs with a short outer dim (the heads permute of attention,
    // [B, T, H, D] <-> [B, H, T, D]): one row-kernel launch per outer index.
    if nd == 4 && p.s0[3] == 1 && p.s1[3] == 1 && p.shape[0] <= 64 {
        for i in 0..p.shape[0] {
            copy_rows(
                rt,
                opname,
                dtype,
                [p.shape[1], p.shape[2], p.shape[3]],
                (src, src_off as i64 + i * p.s0[0], p.s0[1], p.s0[2]),
                (dst, dst_off as i64 + i * p.s1[0], p.s1[1], p.s1[2]),
                op,
            )?;
        }
        return Ok(());
    }
    let (nn, so, dof) = (n as i64, src_off as i64, dst_off as i64);
    let name = Template::CopyNd.at(dtype);
    launch!(rt, opname, name, grid(n); nn, op, p, src, so, dst, dof)
}

/// `batch` x `rows` runs of `run` elements from (pointer, offset, batch stride, row stride)
/// `src` to `dst`, all in elements; `op` as in `copy_nd`.
fn copy_rows(
    rt: &CudaRuntime,
    opname: &'static str,
    dtype: DType,
    [batch, rows, run]: [i64; 3],
    (src, so, bs, ss): (u64, i64, i64, i64),
    (dst, dof, bd, ds): (u64, i64, i64, i64),
    op: i32,
) -> Result<()> {
    let esz = dtype.size() as i64;
    let cfg = |run: i64| rows_grid(batch as usize, rows as usize, run as usize);
    let aligned = op == 0
        && src % 16 == 0
        && dst % 16 == 0
        && [so, bs, ss, dof, bd, ds, run]
            .iter()
            .all(|&v| (v * esz) % 16 == 0);
    if aligned {
        let k = 16 / esz;
        let (run, so, bs, ss, dof, bd, ds) =
            (run / k, so / k, bs / k, ss / k, dof / k, bd / k, ds / k);
        return launch!(rt, opname, Kernel::CopyRowsV16, cfg(run); batch, rows, run, src, so, bs, ss, dst, dof, bd, ds);
    }
    let name = Template::CopyRows.at(dtype);
    launch!(rt, opname, name, cfg(run); batch, rows, run, op, src, so, bs, ss, dst, dof, bd, ds)
}

/// Fills `n` elements at `ptr` with `v` (converted to `dtype`).
pub fn fill(
    rt: &CudaRuntime,
    op: &'static str,
    dtype: DType,
    ptr: u64,
    n: usize,
    v: f64,
    vi: i64,
) -> Result<()> {
    if n == 0 {
        return Ok(());
    }
    let nn = n as i64;
    let name = Template::Fill.at(dtype);
    // The kernel writes 16 bytes a thread.
    let cfg = grid(n.div_ceil(16 / dtype.size()));
    match dtype {
        DType::F32 => {
            let x = v as f32;
            launch!(rt, op, name, cfg; nn, x, ptr)
        }
        DType::F64 => launch!(rt, op, name, cfg; nn, v, ptr),
        DType::I64 => launch!(rt, op, name, cfg; nn, vi, ptr),
        // 16-bit values pass as their bits (the kernels' storage structs hold just those).
        DType::BF16 => {
            let x = <bf16 as Element>::from_f64(v).to_bits();
            launch!(rt, op, name, cfg; nn, x, ptr)
        }
        DType::F16 => {
            let x = <f16 as Element>::from_f64(v).to_bits();
            launch!(rt, op, name, cfg; nn, x, ptr)
        }
    }
}

/// Converts the `n` elements of dtype `from` at `src` to dtype `to` at `dst` (each value
/// rounded once; the same dtype copies).
pub fn cast(
    rt: &CudaRuntime,
    op: &'static str,
    (from, src): (DType, u64),
    (to, dst): (DType, u64),
    n: usize,
) -> Result<()> {
    if n == 0 {
        return Ok(());
    }
    let nn = n as i64;
    if from == to {
        let (one, zero, run) = (1i64, 0i64, nn);
        return copy_rows(
            rt,
            op,
            from,
            [one, one, run],
            (src, zero, zero, zero),
            (dst, zero, zero, zero),
            0,
        );
    }
    // The kernel converts a pack a thread, the wider side of which is 16 bytes.
    let cfg = grid(n.div_ceil(16 / from.size().max(to.size())));
    launch!(rt, op, Kernel::Cast(from, to), cfg; nn, src, dst)
}
