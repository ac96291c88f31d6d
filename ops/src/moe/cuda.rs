//! The mixture-of-experts CUDA kernels (`moe.cu` through the library's NVRTC path, products on
//! cuBLASLt). The expert ids are read back to the host once per call (the products' sizes are
//! the routes each expert got, which cuBLAS takes from the host), grouped there into expert
//! order (row order within an expert) and uploaded as one row list; the rows are gathered into
//! that order, each expert's block multiplied by its matrix, and the results scattered back to
//! row order. Grouped rows, grouped results and the row list are scratch buffers the executor
//! allocates. f32 (without TF32), bf16 and f16 with f32 accumulation; the top-k on f32 and f64
//! probabilities.

use std::sync::Arc;

use cudarc::driver::sys::CUstreamCaptureStatus;
use cudarc::driver::{LaunchConfig, PushKernelArg};
use oxiflow_cuda::kernel_layer::{download, grid, lt_matmul, upload, FloatType, LtMatmul};
use oxiflow_cuda::{
    device_error, launched, CudaKernels, CudaRuntime, CudaSource, CudaStorage, KernelIds,
};
use oxiflow_dtype::DType;
use oxiflow_sbp::Shape;
use oxiflow_tensor::{ExternOp, KernelIo, OutSpec, Result};

use super::{ExpertMatmul, ExpertMatmulWgrad, RouterTopk};
use crate::operand_dtypes::cuda_float_type;

/// The kernels of `moe.cu`.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum MoeKernel {
    /// Rows into expert order, moved as units of this many bytes.
    Gather(usize),
    /// Rows back to row order, units of this many bytes.
    Scatter(usize),
    /// The top-k of f32 (false) or f64 (true) probabilities.
    Topk(bool),
    /// Routes per expert as f32 or f64 counts.
    Count(bool),
}

impl KernelIds for MoeKernel {
    const ALL: &'static [Self] = &[
        MoeKernel::Gather(2),
        MoeKernel::Gather(4),
        MoeKernel::Gather(8),
        MoeKernel::Scatter(2),
        MoeKernel::Scatter(4),
        MoeKernel::Scatter(8),
        MoeKernel::Topk(false),
        MoeKernel::Topk(true),
        MoeKernel::Count(false),
        MoeKernel::Count(true),
    ];
    fn entry(self) -> &'static str {
        match self {
            MoeKernel::Gather(2) => "gather_rows_b2",
            MoeKernel::Gather(8) => "gather_rows_b8",
            MoeKernel::Gather(_) => "gather_rows_b4",
            MoeKernel::Scatter(2) => "scatter_rows_b2",
            MoeKernel::Scatter(8) => "scatter_rows_b8",
            MoeKernel::Scatter(_) => "scatter_rows_b4",
            MoeKernel::Topk(false) => "router_topk_f32",
            MoeKernel::Topk(true) => "router_topk_f64",
            MoeKernel::Count(false) => "count_routes_f32",
            MoeKernel::Count(true) => "count_routes_f64",
        }
    }
}

static SOURCE: CudaSource<MoeKernel> = CudaSource::new("moe", include_str!("moe.cu"));

/// The rows of each of `experts` experts from the ids piece (read back to the host; each id
/// checked to name an expert): the row list in expert order and each expert's count. A typed
/// error while the stream is captured into a device graph.
pub(super) fn grouped(
    rt: &CudaRuntime,
    op: &'static str,
    ids: &CudaStorage,
    experts: usize,
) -> Result<(Vec<i32>, Vec<usize>)> {
    grouped_host(op, &ids_on_host(rt, op, ids)?, experts)
}

/// The i64 expert ids of `ids`, read back to the host. A typed error while the stream is
/// captured into a device graph (which cannot replay a read whose sizes follow from it).
pub(super) fn ids_on_host(
    rt: &CudaRuntime,
    op: &'static str,
    ids: &CudaStorage,
) -> Result<Vec<i64>> {
    if ids.dtype() != DType::I64 {
        return Err(device_error(
            op,
            format!("the expert ids are {}, not i64", ids.dtype()),
        ));
    }
    let capturing = rt
        .stream()
        .capture_status()
        .is_ok_and(|s| s != CUstreamCaptureStatus::CU_STREAM_CAPTURE_STATUS_NONE);
    if capturing {
        return Err(device_error(
            op,
            "it reads each call's routing back to the host, which a device graph cannot \
             replay: run steps with a mixture of experts eagerly on CUDA (without --compile)",
        ));
    }
    let mut host = vec![0i64; ids.numel()];
    download(rt, ids.ptr(), &mut host, op)?;
    Ok(host)
}

/// The rows of each of `experts` experts from host ids `host` (each checked to name an
/// expert): the row list in expert order (row order within an expert) and each expert's count.
pub(super) fn grouped_host(
    op: &'static str,
    host: &[i64],
    experts: usize,
) -> Result<(Vec<i32>, Vec<usize>)> {
    let mut counts = vec![0usize; experts];
    for (m, &e) in host.iter().enumerate() {
        let slot = usize::try_from(e)
            .ok()
            .and_then(|e| counts.get_mut(e))
            .ok_or_else(|| {
                device_error(op, format!("row {m} is routed to expert {e} of {experts}"))
            })?;
        *slot += 1;
    }
    let mut start: Vec<usize> = counts
        .iter()
        .scan(0, |acc, &c| {
            let s = *acc;
            *acc += c;
            Some(s)
        })
        .collect();
    let mut rows = vec![0i32; host.len()];
    for (m, &e) in host.iter().enumerate() {
        let e = e as usize;
        rows[start[e]] = i32::try_from(m)
            .map_err(|_| device_error(op, format!("{} rows exceed i32 indices", host.len())))?;
        start[e] += 1;
    }
    Ok((rows, counts))
}

/// The experts that got rows (of `counts`, each expert's rows): each with its first row in
/// expert order and its number of rows.
pub(super) fn blocks(counts: &[usize]) -> impl Iterator<Item = (usize, usize, usize)> + '_ {
    counts
        .iter()
        .enumerate()
        .scan(0usize, |next, (x, &r)| {
            let first = *next;
            *next += r;
            Some((x, first, r))
        })
        .filter(|&(_, _, r)| r > 0)
}

/// Moves `r` rows of `row_bytes` bytes listed by the i32 row indices at `list`: gathers
/// `from`'s listed rows into `to` (`gather`), or scatters `from`'s rows to the listed rows of
/// `to`.
pub(super) fn move_rows(
    rt: &Arc<CudaRuntime>,
    op: &'static str,
    gather: bool,
    (from, to): (u64, u64),
    (list, r): (u64, usize),
    row_bytes: usize,
) -> Result<()> {
    if r == 0 || row_bytes == 0 {
        return Ok(());
    }
    let unit = [8, 4, 2]
        .into_iter()
        .find(|&u| {
            row_bytes.is_multiple_of(u)
                && from.is_multiple_of(u as u64)
                && to.is_multiple_of(u as u64)
        })
        .ok_or_else(|| device_error(op, format!("rows of {row_bytes} bytes")))?;
    let kernel = if gather {
        MoeKernel::Gather(unit)
    } else {
        MoeKernel::Scatter(unit)
    };
    let f = SOURCE.function(rt, op, kernel)?;
    let (count, units) = (r as i64, (row_bytes / unit) as i64);
    let mut l = rt.launcher(op, f)?;
    l.arg(&from).arg(&list).arg(&to).arg(&count).arg(&units);
    // SAFETY: the kernel takes (const U*, const int*, U*, i64, i64); `list` holds `r` i32 row
    // indices below the source's (gather) or destination's (scatter) row count, checked on
    // the host; both buffers hold their rows of `units` units and outlive the launch.
    launched(op, unsafe { l.launch(grid(r * units as usize)) })
}

/// One product of cuBLASLt, row-major: `out [m, n] = a [m, k] @ b [k, n]` with `ta`/`tb` for
/// operands stored transposed (f32 without TF32).
pub(super) fn product(
    rt: &Arc<CudaRuntime>,
    t: FloatType,
    dims: (usize, usize, usize),
    stored: (bool, bool),
    at: (u64, u64, u64),
) -> Result<()> {
    product_plus(rt, t, dims, stored, at, 0.0)
}

/// [`product`] added to `beta` times what `out` holds.
pub(super) fn product_plus(
    rt: &Arc<CudaRuntime>,
    t: FloatType,
    dims: (usize, usize, usize),
    stored: (bool, bool),
    (a, b, out): (u64, u64, u64),
    beta: f32,
) -> Result<()> {
    let g = LtMatmul {
        beta,
        ..LtMatmul::new(dims, stored, (t, false))
    };
    Ok(lt_matmul(rt, &g, a, b, out)?)
}

pub(super) fn spec(dims: &[usize], dtype: DType) -> OutSpec {
    OutSpec {
        shape: Shape::from(dims),
        dtype,
    }
}

/// Buffers `[m, w]` of `dtype` for each width `w` of `widths`, then the row list of `m` rows
/// (i32 as i64 words).
pub(super) fn rows_and_list(m: usize, dtype: DType, widths: &[usize]) -> Vec<OutSpec> {
    widths
        .iter()
        .map(|&w| spec(&[m, w], dtype))
        .chain([spec(&[m.div_ceil(2)], DType::I64)])
        .collect()
}

/// The scratch of a product over `m` rows: the rows in expert order `[m, inner]`, their
/// results `[m, outer]` and the row list (i32 as i64 words).
pub(super) fn matmul_scratch(
    op: &ExpertMatmul,
    ins: &[OutSpec],
    _outs: &[OutSpec],
) -> Vec<OutSpec> {
    let (x, w) = (&ins[0], ins.get(2));
    let (m, inner) = (x.shape.dim(0), x.shape.dim(1));
    let outer = w.map_or(0, |w| w.shape.dim(if op.transposed { 0 } else { 1 }));
    rows_and_list(m, x.dtype, &[inner, outer])
}

pub(super) fn expert_matmul(
    op: &ExpertMatmul,
    b: &CudaKernels,
    io: KernelIo<'_, CudaKernels>,
) -> Result<()> {
    let name = op.name();
    let rt = b.runtime();
    let (x, ids, ws) = match io.inputs {
        [x, ids, ws @ ..] if ws.len() == op.experts => (x, ids, ws),
        _ => {
            return Err(device_error(
                name,
                format!("expects x, ids and {} matrices", op.experts),
            ))
        }
    };
    let ([y], [xs, ys, list]) = (&*io.outputs, &*io.scratch) else {
        return Err(device_error(name, "expects 1 output and 3 scratch buffers"));
    };
    let t = cuda_float_type(name, x.dtype())?;
    let (m, inner) = (x.shape().dim(0), x.shape().dim(1));
    let (wk, wn) = ws
        .first()
        .map_or((0, 0), |w| (w.shape().dim(0), w.shape().dim(1)));
    let outer = if op.transposed { wk } else { wn };
    let w_inner = if op.transposed { wn } else { wk };
    if w_inner != inner
        || ws
            .iter()
            .any(|w| w.shape().dims() != [wk, wn] || w.dtype() != x.dtype())
        || y.shape().dims() != [m, outer]
    {
        return Err(device_error(
            name,
            format!(
                "rows {} against matrices [{wk}, {wn}] into {}",
                x.shape(),
                y.shape()
            ),
        ));
    }
    if m == 0 || outer == 0 {
        return Ok(());
    }
    if inner == 0 {
        return zero(rt, name, y);
    }
    let (rows, counts) = grouped(rt, name, ids, op.experts)?;
    upload(rt, list.ptr(), &rows, name)?;
    let elem = t.size();
    move_rows(
        rt,
        name,
        true,
        (x.ptr(), xs.ptr()),
        (list.ptr(), m),
        inner * elem,
    )?;
    for (x, at, r) in blocks(&counts) {
        let (a, o) = (
            xs.ptr() + (at * inner * elem) as u64,
            ys.ptr() + (at * outer * elem) as u64,
        );
        let dims = (r, outer, inner);
        product(rt, t, dims, (false, op.transposed), (a, ws[x].ptr(), o))?;
    }
    move_rows(
        rt,
        name,
        false,
        (ys.ptr(), y.ptr()),
        (list.ptr(), m),
        outer * elem,
    )
}

/// The scratch of a weight gradient over `m` rows: both operands' rows in expert order and the
/// row list.
pub(super) fn wgrad_scratch(
    _op: &ExpertMatmulWgrad,
    ins: &[OutSpec],
    _outs: &[OutSpec],
) -> Vec<OutSpec> {
    let (a, bm) = (&ins[0], &ins[2]);
    let m = a.shape.dim(0);
    vec![
        spec(&[m, a.shape.dim(1)], a.dtype),
        spec(&[m, bm.shape.dim(1)], bm.dtype),
        spec(&[m.div_ceil(2)], DType::I64),
    ]
}

pub(super) fn expert_matmul_wgrad(
    op: &ExpertMatmulWgrad,
    b: &CudaKernels,
    io: KernelIo<'_, CudaKernels>,
) -> Result<()> {
    let name = op.name();
    let rt = b.runtime();
    let ([a, ids, bm], [a_s, b_s, list]) = (io.inputs, &*io.scratch) else {
        return Err(device_error(
            name,
            "expects a, ids, b and 3 scratch buffers",
        ));
    };
    let t = cuda_float_type(name, a.dtype())?;
    let (m, ka, nb) = (a.shape().dim(0), a.shape().dim(1), bm.shape().dim(1));
    if bm.shape().dim(0) != m
        || bm.dtype() != a.dtype()
        || io.outputs.len() != op.experts
        || io.outputs.iter().any(|g| g.shape().dims() != [ka, nb])
    {
        return Err(device_error(
            name,
            format!(
                "a {} and b {} into {} matrices [{ka}, {nb}]",
                a.shape(),
                bm.shape(),
                op.experts
            ),
        ));
    }
    let elem = t.size();
    let (rows, counts) = if m == 0 {
        (Vec::new(), vec![0; op.experts])
    } else {
        grouped(rt, name, ids, op.experts)?
    };
    if m > 0 {
        upload(rt, list.ptr(), &rows, name)?;
        let rows = (list.ptr(), m);
        move_rows(rt, name, true, (a.ptr(), a_s.ptr()), rows, ka * elem)?;
        move_rows(rt, name, true, (bm.ptr(), b_s.ptr()), rows, nb * elem)?;
    }
    // An expert no row reaches keeps a zero gradient.
    for g in io.outputs.iter() {
        zero(rt, name, g)?;
    }
    if ka * nb == 0 {
        return Ok(());
    }
    for (x, at, r) in blocks(&counts) {
        let (ap, bp) = (
            a_s.ptr() + (at * ka * elem) as u64,
            b_s.ptr() + (at * nb * elem) as u64,
        );
        product(
            rt,
            t,
            (ka, nb, r),
            (true, false),
            (ap, bp, io.outputs[x].ptr()),
        )?;
    }
    Ok(())
}

/// Fills `x` with zero bytes on the compute stream.
pub(super) fn zero(rt: &CudaRuntime, op: &'static str, x: &CudaStorage) -> Result<()> {
    let bytes = x.numel() * x.dtype().size();
    if bytes == 0 {
        return Ok(());
    }
    rt.bind(op)?;
    // SAFETY: `x` holds `bytes` bytes and outlives the queued fill (the caller holds it).
    unsafe { cudarc::driver::result::memset_d8_async(x.ptr(), 0, bytes, rt.stream().cu_stream()) }
        .map_err(|e| device_error(op, format!("zero fill: {e}")))
}

/// Threads of a `count_routes` block (the kernel's `COUNT_THREADS`).
const COUNT_THREADS: u32 = 256;

pub(super) fn router_topk(
    op: &RouterTopk,
    b: &CudaKernels,
    io: KernelIo<'_, CudaKernels>,
) -> Result<()> {
    let name = op.name();
    let rt = b.runtime();
    let ([p], [ids, counts]) = (io.inputs, &*io.outputs) else {
        return Err(device_error(name, "expects 1 input and 2 outputs"));
    };
    let wide = match p.dtype() {
        DType::F32 => false,
        DType::F64 => true,
        d => return Err(device_error(name, format!("probabilities of {d}"))),
    };
    let (m, experts) = (p.shape().dim(0), p.shape().dim(1));
    if op.k == 0 || op.k > experts {
        return Err(device_error(
            name,
            format!("top {} of {experts} experts", op.k),
        ));
    }
    if ids.dtype() != DType::I64
        || ids.shape().dims() != [m, op.k]
        || counts.dtype() != p.dtype()
        || counts.numel() != experts
        || experts > i32::MAX as usize
    {
        return Err(device_error(
            name,
            format!(
                "outputs {} {} and {} {} for [{m}, {experts}] probabilities",
                ids.dtype(),
                ids.shape(),
                counts.dtype(),
                counts.shape()
            ),
        ));
    }
    let (e, k) = (experts as i32, op.k as i32);
    if m > 0 {
        let f = SOURCE.function(rt, name, MoeKernel::Topk(wide))?;
        let (pp, ip, rows) = (p.ptr(), ids.ptr(), m as i64);
        let mut l = rt.launcher(name, f)?;
        l.arg(&pp).arg(&ip).arg(&rows).arg(&e).arg(&k);
        // SAFETY: router_topk_<T> takes (const T*, i64*, i64, int, int); `p` holds m x e
        // values of T and `ids` m x k i64 (checked above); both outlive the launch.
        launched(name, unsafe { l.launch(grid(m)) })?;
    }
    let f = SOURCE.function(rt, name, MoeKernel::Count(wide))?;
    let (ip, n, cp) = (ids.ptr(), (m * op.k) as i64, counts.ptr());
    let mut l = rt.launcher(name, f)?;
    l.arg(&ip).arg(&n).arg(&cp).arg(&e);
    // A block of the kernel's COUNT_THREADS threads per expert.
    let per_expert = LaunchConfig {
        grid_dim: (experts.clamp(1, 65535) as u32, 1, 1),
        block_dim: (COUNT_THREADS, 1, 1),
        shared_mem_bytes: 0,
    };
    // SAFETY: count_routes_<T> takes (const i64*, i64, T*, int) and runs COUNT_THREADS threads
    // a block (its shared array's length); `ids` holds n i64 ids (none read when n is 0) and
    // `counts` e values of T; both outlive the launch.
    launched(name, unsafe { l.launch(per_expert) })
}
