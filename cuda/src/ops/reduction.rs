//! Reduction CUDA kernels, written into the executor's output piece: sum, mean, max and min over dims (leading dims by
//! column passes, a short run of middle dims in place, else a permute then a per-row reduction), and sum-to-shape.

use std::sync::Arc;

use oxiflow_sbp::Shape;

use super::super::kernels::{grid, launch, per_row, Template};
use super::super::storage::CudaStorage;
use super::super::{derr, CudaRuntime};
use super::{float_only, permute, CudaKernels};
use oxiflow_tensor::backend::{Extremum, ReductionKernels};
use oxiflow_tensor::Result;

/// What a row reduction combines with (the kernel's `mode`: 0 sum, 1 max, 2 min).
#[derive(Clone, Copy)]
enum Combine {
    Sum = 0,
    Max = 1,
    Min = 2,
}

/// Sum, max or min over `dims`, times `scale`, into `out` (one element per kept position,
/// whatever its shape: with or without the reduced dims as 1, or a shape they broadcast from).
fn reduce(
    rt: &Arc<CudaRuntime>,
    op: &'static str,
    x: &CudaStorage,
    dims: &[usize],
    combine: Combine,
    scale: f64,
    out: &CudaStorage,
) -> Result<()> {
    let d = x.shape.dims();
    let mut red: Vec<usize> = dims.to_vec();
    red.sort_unstable();
    red.dedup();
    if red.iter().any(|&i| i >= d.len()) {
        return Err(derr(
            op,
            format!("dims {dims:?} out of range for {}", x.shape),
        ));
    }
    let keep: Vec<usize> = (0..d.len()).filter(|i| !red.contains(i)).collect();
    let perm: Vec<usize> = keep.iter().chain(red.iter()).copied().collect();
    let rows: usize = keep.iter().map(|&i| d[i]).product();
    let len: usize = red.iter().map(|&i| d[i]).product();
    if out.numel() != rows || out.dtype != x.dtype {
        return Err(derr(
            op,
            format!(
                "{} reduced over {dims:?} does not fit the output {} {}",
                x.shape, out.dtype, out.shape
            ),
        ));
    }
    if rows == 0 {
        return Ok(());
    }
    // Sums over leading dims (bias gradients): column sums in two deterministic passes, no
    // transposed copy.
    let leading = red.iter().enumerate().all(|(i, &d)| i == d);
    if leading && !red.is_empty() && len > 1 && matches!(combine, Combine::Sum) {
        return column_sum(rt, op, x, out, [len, rows], scale);
    }
    // A short run of consecutive reduced dims before kept ones (the sum over top-k routes of
    // `[tokens, k, width]`): one thread per output reads it in place, no transposed copy.
    let consecutive = red.windows(2).all(|w| w[1] == w[0] + 1);
    let inner: usize = d[red.last().map_or(d.len(), |&l| l + 1)..].iter().product();
    if consecutive && !red.is_empty() && inner > 1 && len <= MID_MAX_LEN {
        let outer = rows / inner;
        let (o, l, inn, mx, sc, xp, yp) = (
            outer as i64,
            len as i64,
            inner as i64,
            combine as i32,
            scale,
            x.ptr(),
            out.ptr(),
        );
        let name = Template::ReduceMid.at(x.dtype);
        return launch!(rt, op, name, grid(rows); o, l, inn, mx, sc, xp, yp);
    }
    let identity = perm.iter().enumerate().all(|(i, &p)| i == p);
    let tmp;
    let src = if identity || len <= 1 {
        x
    } else {
        tmp = permute(rt, x, &perm)?;
        &tmp
    };
    let (r, l, mx, sc, xp, yp) = (
        rows as i64,
        len as i64,
        combine as i32,
        scale,
        src.ptr(),
        out.ptr(),
    );
    let name = Template::ReduceRows.at(x.dtype);
    launch!(rt, op, name, per_row(rows); r, l, mx, sc, xp, yp)
}

/// The longest run of reduced elements one thread of a middle-dim reduction walks (longer
/// runs with few outputs take the block-per-row kernel).
const MID_MAX_LEN: usize = 64;

/// Rows of a column-sum pass: each thread sums `CHUNK` rows of its column.
const CHUNK: usize = 64;

/// Most partial rows a last column-sum pass sums per thread.
const LAST_PASS_ROWS: usize = 1024;

/// Elements one block sums in the first pass of a whole-piece sum.
const SPAN: usize = 16384;

/// `out[c] = scale * sum_r x[r, c]` for x `[rows, cols]`: passes of `CHUNK`-row partial sums
/// (each reading coalesced rows) until at most `LAST_PASS_ROWS` partial rows are left, then
/// their sum; deterministic. A single column is a contiguous sum ([`contiguous_sum`]).
fn column_sum(
    rt: &Arc<CudaRuntime>,
    op: &'static str,
    x: &CudaStorage,
    out: &CudaStorage,
    [rows, cols]: [usize; 2],
    scale: f64,
) -> Result<()> {
    if cols == 1 {
        return contiguous_sum(rt, op, x, out, rows, scale);
    }
    let name = Template::ReduceCols.at(x.dtype);
    let pass = |src: u64, dst: u64, r: usize, chunk: usize, sc: f64| -> Result<()> {
        let (rr, cc, ch, xp, yp) = (r as i64, cols as i64, chunk as i64, src, dst);
        let groups = r.div_ceil(chunk);
        launch!(rt, op, name, grid(groups * cols); rr, cc, ch, sc, xp, yp)
    };
    // The partial sums are scratch pieces, each kept until the next pass has read it.
    let mut part: Option<CudaStorage> = None;
    let mut r = rows;
    loop {
        let src = part.as_ref().map_or(x.ptr(), |p| p.ptr());
        if r <= LAST_PASS_ROWS {
            return pass(src, out.ptr(), r, r.max(1), scale);
        }
        let chunks = r.div_ceil(CHUNK);
        let next = CudaStorage::alloc(rt, x.dtype, Shape::new([chunks, cols]))?;
        pass(src, next.ptr(), r, CHUNK, 1.0)?;
        part = Some(next);
        r = chunks;
    }
}

/// `out[0] = scale * sum x` over `n` contiguous elements: one block per `SPAN` elements (the
/// row kernel on `[n / SPAN, SPAN]`, the tail as one more row), then one block over the
/// partial sums; deterministic.
fn contiguous_sum(
    rt: &Arc<CudaRuntime>,
    op: &'static str,
    x: &CudaStorage,
    out: &CudaStorage,
    n: usize,
    scale: f64,
) -> Result<()> {
    let name = Template::ReduceRows.at(x.dtype);
    let mx = Combine::Sum as i32;
    let rows_pass = |src: u64, dst: u64, rows: usize, len: usize, sc: f64| -> Result<()> {
        let (r, l, xp, yp) = (rows as i64, len as i64, src, dst);
        launch!(rt, op, name, per_row(rows); r, l, mx, sc, xp, yp)
    };
    if n <= 4 * SPAN {
        return rows_pass(x.ptr(), out.ptr(), 1, n, scale);
    }
    let (full, tail) = (n / SPAN, n % SPAN);
    let parts = full + usize::from(tail > 0);
    let part = CudaStorage::alloc(rt, x.dtype, Shape::new([parts]))?;
    let esize = x.dtype.size() as u64;
    rows_pass(x.ptr(), part.ptr(), full, SPAN, 1.0)?;
    if tail > 0 {
        let at = (full * SPAN) as u64 * esize;
        rows_pass(x.ptr() + at, part.ptr() + full as u64 * esize, 1, tail, 1.0)?;
    }
    rows_pass(part.ptr(), out.ptr(), 1, parts, scale)
}

impl ReductionKernels for CudaKernels {
    fn sum(
        &self,
        x: &CudaStorage,
        dims: &[usize],
        _keepdim: bool,
        count: Option<usize>,
        out: &mut CudaStorage,
    ) -> Result<()> {
        match count {
            Some(count) => {
                float_only("mean", x.dtype)?;
                let scale = 1.0 / count.max(1) as f64;
                reduce(&self.rt, "mean", x, dims, Combine::Sum, scale, out)
            }
            None => reduce(&self.rt, "sum", x, dims, Combine::Sum, 1.0, out),
        }
    }

    fn extremum(
        &self,
        which: Extremum,
        x: &CudaStorage,
        dims: &[usize],
        out: &mut CudaStorage,
    ) -> Result<()> {
        let combine = match which {
            Extremum::Max => Combine::Max,
            Extremum::Min => Combine::Min,
        };
        reduce(&self.rt, which.name(), x, dims, combine, 1.0, out)
    }

    fn sum_to_shape(&self, a: &CudaStorage, out: &mut CudaStorage) -> Result<()> {
        let s = a.shape.dims();
        let t = out.shape.dims();
        let lead = s.len().saturating_sub(t.len());
        let dims: Vec<usize> = (0..s.len())
            .filter(|&d| d < lead || (t[d - lead] == 1 && s[d] != 1))
            .collect();
        reduce(&self.rt, "sum_to_shape", a, &dims, Combine::Sum, 1.0, out)
    }
}
