//! The decoding ops' CUDA kernels (`decode.cu`), compiled once per process through the
//! library's NVRTC path and looked up by [`DecodeKernel`]; launches on the compute stream into
//! the executor's outputs (a cache write into the cache's own memory when the output is it).

use cudarc::driver::{DeviceRepr, LaunchConfig, PushKernelArg};
use oxiflow_cuda::kernel_layer::grid;
use oxiflow_cuda::{device_error, launched, CudaKernels, CudaSource, CudaStorage};
use oxiflow_dtype::DType;
use oxiflow_tensor::{ExternOp, KernelIo, Result};

use super::op_types::{
    DecodeAttention, DecodeAttentionParts, RotaryAt, RotaryQkvAt, WriteRows, MAX_HEAD_DIM,
};

/// The kernels of `decode.cu`: rotary and attention by element type, the cache writes (one
/// cache, or a table of them) by element width in bytes.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum DecodeKernel {
    Rotary(DType),
    RotaryQkv(DType),
    Attention(DType),
    Parts(DType),
    Rows(usize),
    RowsTable(usize),
}

oxiflow_cuda::kernel_ids!(DecodeKernel {
    [F32, F64, BF16, F16] {
        Rotary => "rotary_at",
        RotaryQkv => "rotary_qkv_at",
        Attention => "decode_attention",
        Parts => "decode_attention_parts",
    },
    [2, 4, 8] { Rows => "write_rows", RowsTable => "write_rows_table" },
});

static SOURCE: CudaSource<DecodeKernel> = CudaSource::new("decode", include_str!("decode.cu"));

/// Warps of a decoding attention block of `dtype` (the kernels' `WARPS` in the source).
fn attention_warps(dtype: DType) -> usize {
    if dtype == DType::F64 {
        8
    } else {
        16
    }
}

fn dims4(op: &'static str, what: &str, p: &CudaStorage) -> Result<[usize; 4]> {
    match p.shape().dims() {
        &[a, b, c, d] => Ok([a, b, c, d]),
        _ => Err(device_error(
            op,
            format!("{what} must be 4-d, got {}", p.shape()),
        )),
    }
}

pub(super) fn rotary_at(
    op: &RotaryAt,
    b: &CudaKernels,
    io: KernelIo<'_, CudaKernels>,
) -> Result<()> {
    let name = op.name();
    let ([x, freq, pos], [y]) = (io.inputs, &*io.outputs) else {
        return Err(device_error(name, "expects 3 inputs and 1 output"));
    };
    let [_, t, h, d] = dims4(name, "x", x)?;
    if y.numel() != x.numel() || y.dtype() != x.dtype() || freq.numel() * 2 != d || pos.numel() != 1
    {
        return Err(device_error(
            name,
            format!(
                "x {} {}, frequencies {}, position {}, output {} {}",
                x.dtype(),
                x.shape(),
                freq.shape(),
                pos.shape(),
                y.dtype(),
                y.shape()
            ),
        ));
    }
    let pairs = x.numel() / 2;
    let ptrs = [x.ptr(), freq.ptr(), pos.ptr(), y.ptr()];
    let dims = [pairs, t, h, d].map(|v| v as i64);
    let kernel = DecodeKernel::Rotary(x.dtype());
    // SAFETY: rotary_at_<dtype> takes (const T*, const double*, const i64*, T*, i64 pairs,
    // i64 t, i64 h, i64 d); x and y hold 2 * pairs elements of T, freq d / 2 f64 (the op's
    // inference checked its dtype), pos one i64; the pieces outlive the launch.
    unsafe { launch_pairs(b, name, kernel, (&ptrs, &dims), pairs) }
}

/// Launches `kernel` over `pairs` element pairs (nothing where there are none), its
/// arguments the pointers `args.0`, then the i64 `args.1`.
///
/// # Safety
/// The pointers and then the integers must be the kernel's parameters, in order, and every
/// pointer a live allocation covering what the kernel indexes for `pairs` pairs.
unsafe fn launch_pairs(
    b: &CudaKernels,
    name: &'static str,
    kernel: DecodeKernel,
    (ptrs, dims): (&[u64], &[i64]),
    pairs: usize,
) -> Result<()> {
    if pairs == 0 {
        return Ok(());
    }
    let rt = b.runtime();
    let f = SOURCE.function(rt, name, kernel)?;
    let mut l = rt.launcher(name, f)?;
    for p in ptrs {
        l.arg(p);
    }
    for n in dims {
        l.arg(n);
    }
    // SAFETY: the caller's contract: these are the kernel's arguments, and the pointers cover
    // what it indexes for `pairs` pairs.
    launched(name, unsafe { l.launch(grid(pairs)) })
}

pub(super) fn rotary_qkv_at(
    op: &RotaryQkvAt,
    b: &CudaKernels,
    io: KernelIo<'_, CudaKernels>,
) -> Result<()> {
    let name = op.name();
    let ([x, freq, pos], [q, k, v]) = (io.inputs, &*io.outputs) else {
        return Err(device_error(name, "expects 3 inputs and 3 outputs"));
    };
    let (t, g, r2, d) = match x.shape().dims() {
        &[_, t, g, r2, d] if r2 >= 3 => (t, g, r2, d),
        _ => {
            return Err(device_error(
                name,
                format!("qkv must be [B, T, G, R + 2, D], got {}", x.shape()),
            ))
        }
    };
    let heads = x.numel() / d.max(1);
    let (rows, r) = (heads / (g * r2).max(1), r2 - 2);
    let dt = x.dtype();
    let fits = freq.numel() * 2 == d
        && pos.numel() == 1
        && q.numel() == rows * g * r * d
        && k.numel() == rows * g * d
        && v.numel() == k.numel()
        && [q, k, v].iter().all(|p| p.dtype() == dt);
    if !fits {
        return Err(device_error(
            name,
            format!(
                "qkv {} {}, frequencies {}, position {}, outputs {} {} {}",
                dt,
                x.shape(),
                freq.shape(),
                pos.shape(),
                q.shape(),
                k.shape(),
                v.shape()
            ),
        ));
    }
    let pairs = x.numel() / 2;
    let ptrs = [x.ptr(), freq.ptr(), pos.ptr(), q.ptr(), k.ptr(), v.ptr()];
    let dims = [pairs, t, g, r, d].map(|v| v as i64);
    let kernel = DecodeKernel::RotaryQkv(dt);
    // SAFETY: rotary_qkv_at_<dtype> takes (const T* x, const double* freq, const i64* pos,
    // T* q, T* k, T* v, i64 pairs, i64 t, i64 g, i64 r, i64 d); x holds 2 * pairs elements of
    // T in rows of G (R + 2) heads of D, q R heads of D and k and v one per group and row
    // (checked above), freq D / 2 f64 (the op's inference checked its dtype), pos one i64;
    // the pieces outlive the launch.
    unsafe { launch_pairs(b, name, kernel, (&ptrs, &dims), pairs) }
}

pub(super) fn decode_attention(
    op: &DecodeAttention,
    b: &CudaKernels,
    io: KernelIo<'_, CudaKernels>,
) -> Result<()> {
    let name = op.name();
    let ([q, kc, vc, kn, vn, pos], [y]) = (io.inputs, &*io.outputs) else {
        return Err(device_error(name, "expects 6 inputs and 1 output"));
    };
    let [bs, h, g, d, p_len] = heads_operands(name, [q, kc, vc, kn, vn, pos], &[y])?;
    let dtype = q.dtype();
    if y.numel() != q.numel() || y.dtype() != dtype {
        return Err(device_error(
            name,
            format!("output {} {} for q {}", y.dtype(), y.shape(), q.shape()),
        ));
    }
    if q.numel() == 0 {
        return Ok(());
    }
    let kernel = DecodeKernel::Attention(dtype);
    let cfg = heads_launch(dtype, (h, bs, 1), d);
    let ints = [
        Int::Long(p_len as i64),
        Int::Int(h as i32),
        Int::Int(g as i32),
        Int::Int(d as i32),
    ];
    let pieces: HeadsPieces = ([q, kc, vc, kn, vn, pos], &[y]);
    // SAFETY: decode_attention_<dtype> takes (q, kc, vc, kn, vn: const T*, pos: const i64*,
    // y: T*, i64 p_len, int h, int g, int d, W scale) with W f64 for f64 and f32 otherwise;
    // the pieces hold the element counts checked above, the block's dynamic shared memory is
    // d + WARPS * (d + 2) W's for the kernel's WARPS, and the pieces outlive the launch.
    unsafe { launch_heads(b, name, (kernel, cfg), pieces, &ints, op.scale) }
}

/// A decoding attention kernel's input pieces (q, the caches, the new key and value, the
/// position) and output pieces.
type HeadsPieces<'a> = ([&'a CudaStorage; 6], &'a [&'a CudaStorage]);

/// An integer argument of a decoding attention kernel: an i64 or an int.
#[derive(Clone, Copy)]
enum Int {
    Long(i64),
    Int(i32),
}

/// Launches decoding attention kernel `kernel` over `cfg`, its arguments the pointers of the
/// input and output `pieces`, the integers `ints`, then `scale` in the kernel's arithmetic (f64
/// where q, the first input, is f64, else f32).
///
/// # Safety
/// These must be the kernel's parameters in order, every piece covering what the kernel
/// indexes, and `cfg` a launch the kernel runs in (its dynamic shared memory included).
unsafe fn launch_heads(
    b: &CudaKernels,
    name: &'static str,
    (kernel, cfg): (DecodeKernel, LaunchConfig),
    (ins, outs): HeadsPieces<'_>,
    ints: &[Int],
    scale: f64,
) -> Result<()> {
    let rt = b.runtime();
    let f = SOURCE.function(rt, name, kernel)?;
    let ptrs: Vec<u64> = ins.iter().chain(outs).map(|p| p.ptr()).collect();
    let mut l = rt.launcher(name, f)?;
    for p in &ptrs {
        l.arg(p);
    }
    for a in ints {
        match a {
            Int::Long(v) => l.arg(v),
            Int::Int(v) => l.arg(v),
        };
    }
    let (s64, s32) = (scale, scale as f32);
    if ins[0].dtype() == DType::F64 {
        l.arg(&s64);
    } else {
        l.arg(&s32);
    }
    // SAFETY: the caller's contract: these are the kernel's arguments and launch, and the
    // pieces cover what it indexes.
    launched(name, unsafe { l.launch(cfg) })
}

/// A decoding attention's operands checked (q `[B, 1, H, D]`, caches `[B, P, G, D]` and the
/// new key and value `[B, 1, G, D]` of q's dtype, G dividing H, D at most [`MAX_HEAD_DIM`],
/// one position; `outs` only named in the error): `[B, H, G, D, P]`.
fn heads_operands(
    name: &'static str,
    [q, kc, vc, kn, vn, pos]: [&CudaStorage; 6],
    outs: &[&CudaStorage],
) -> Result<[usize; 5]> {
    let [bs, _, h, d] = dims4(name, "q", q)?;
    let [_, p_len, g, _] = dims4(name, "the key cache", kc)?;
    let dtype = q.dtype();
    let fits = g > 0
        && h % g == 0
        && d <= MAX_HEAD_DIM
        && [kc, vc, kn, vn].iter().all(|p| p.dtype() == dtype)
        && vc.numel() == kc.numel()
        && kc.numel() == bs * p_len * g * d
        && kn.numel() == bs * g * d
        && vn.numel() == kn.numel()
        && pos.numel() == 1;
    if !fits {
        let outs: Vec<String> = outs.iter().map(|o| o.shape().to_string()).collect();
        return Err(device_error(
            name,
            format!(
                "q {} {}, caches {} {}, key/value {} {}, outputs {}",
                dtype,
                q.shape(),
                kc.shape(),
                vc.shape(),
                kn.shape(),
                vn.shape(),
                outs.join(", ")
            ),
        ));
    }
    Ok([bs, h, g, d, p_len])
}

/// The launch of a decoding attention kernel of `dtype` over `grid` (heads, sequences,
/// blocks) for heads of `d`: the kernel's WARPS warps a block, its dynamic shared memory
/// `d + WARPS * (d + 2)` elements of its arithmetic (f64 for f64, else f32).
fn heads_launch(dtype: DType, grid: (usize, usize, usize), d: usize) -> LaunchConfig {
    let wide = if dtype == DType::F64 { 8 } else { 4 };
    let warps = attention_warps(dtype);
    LaunchConfig {
        grid_dim: (grid.0 as u32, grid.1 as u32, grid.2 as u32),
        block_dim: (32 * warps as u32, 1, 1),
        shared_mem_bytes: (wide * (d + warps * (d + 2))) as u32,
    }
}

pub(super) fn decode_attention_parts(
    op: &DecodeAttentionParts,
    b: &CudaKernels,
    io: KernelIo<'_, CudaKernels>,
) -> Result<()> {
    let name = op.name();
    let ([q, kc, vc, kn, vn, pos], [o, lse]) = (io.inputs, &*io.outputs) else {
        return Err(device_error(name, "expects 6 inputs and 2 outputs"));
    };
    let [bs, h, g, d, p_len] = heads_operands(name, [q, kc, vc, kn, vn, pos], &[o, lse])?;
    let [_, nl, _, _] = dims4(name, "the blocks' values", o)?;
    let per = op.block_len(p_len, nl).map_err(|e| device_error(name, e))?;
    let dtype = q.dtype();
    let wide = dtype.compute();
    let fits = [o, lse].iter().all(|p| p.dtype() == wide)
        && o.numel() == bs * nl * h * d
        && lse.numel() == bs * nl * h;
    if !fits {
        return Err(device_error(
            name,
            format!(
                "blocks {} {} and {} for q {} {}",
                o.dtype(),
                o.shape(),
                lse.shape(),
                dtype,
                q.shape()
            ),
        ));
    }
    if o.numel() == 0 {
        return Ok(());
    }
    let kernel = DecodeKernel::Parts(dtype);
    let cfg = heads_launch(dtype, (h, bs, nl), d);
    let ints = [
        Int::Long(per as i64),
        Int::Int(nl as i32),
        Int::Long(op.first_block as i64),
        Int::Long(op.blocks as i64),
        Int::Int(h as i32),
        Int::Int(g as i32),
        Int::Int(d as i32),
    ];
    let pieces: HeadsPieces = ([q, kc, vc, kn, vn, pos], &[o, lse]);
    // SAFETY: decode_attention_parts_<dtype> takes (q, kc, vc, kn, vn: const T*, pos: const
    // i64*, o, lse: W*, i64 per, int nl, i64 first_block, i64 blocks, int h, int g, int d,
    // W scale) with W f64 for f64 and f32 otherwise (the outputs' dtype, checked); the pieces
    // hold the element counts checked above (caches of nl blocks of per positions), the
    // block's dynamic shared memory is d + WARPS * (d + 2) W's for the kernel's WARPS, and the
    // pieces outlive the launch.
    unsafe { launch_heads(b, name, (kernel, cfg), pieces, &ints, op.scale) }
}

/// One cache write's pieces and geometry, checked: rows `from..from + count` of `rows` go into
/// `out` (the cache's own memory where `in_place`) at `at..at + count` of a dim of `len`
/// positions, with `outer` runs before it and `inner` elements after it, `width` bytes an
/// element.
struct RowsWrite<'a> {
    cache: &'a CudaStorage,
    rows: &'a CudaStorage,
    out: &'a CudaStorage,
    geometry: RowsGeometry,
    in_place: bool,
}

#[derive(Clone, Copy, PartialEq, Eq)]
struct RowsGeometry {
    outer: usize,
    len: usize,
    t: usize,
    inner: usize,
    width: usize,
    /// The rows written: `count` of the `t` given, from `from`.
    from: usize,
    count: usize,
}

impl RowsGeometry {
    /// The kernels' geometry arguments for a write at `at`: (outer, len, t, inner, at, from,
    /// count).
    fn args(&self, at: usize) -> [i64; 7] {
        [
            self.outer, self.len, self.t, self.inner, at, self.from, self.count,
        ]
        .map(|v| v as i64)
    }
}

/// Caches in one launch of `write_rows_table_b<width>` (the kernels' `ROWS_TABLE`).
const ROWS_TABLE: usize = 64;

/// The pointer table of `write_rows_table_b<width>` (`struct RowsTable`).
#[repr(C)]
#[derive(Clone, Copy)]
struct RowsTable {
    rows: [u64; ROWS_TABLE],
    out: [u64; ROWS_TABLE],
}
// SAFETY: plain old data with the C layout of `struct RowsTable`.
unsafe impl DeviceRepr for RowsTable {}

pub(super) fn write_rows(
    op: &WriteRows,
    b: &CudaKernels,
    io: KernelIo<'_, CudaKernels>,
) -> Result<()> {
    let name = op.name();
    let n = io.outputs.len();
    if io.inputs.len() != 2 * n {
        return Err(device_error(
            name,
            format!("{} inputs for {n} caches", io.inputs.len()),
        ));
    }
    let mut writes = Vec::with_capacity(n);
    for i in 0..n {
        let (cache, rows, out) = (io.inputs[i], io.inputs[n + i], &io.outputs[i]);
        let dims = cache.shape().dims();
        let (Some(&len), Some(&t)) = (dims.get(op.dim), rows.shape().dims().get(op.dim)) else {
            return Err(device_error(
                name,
                format!("cache {}, rows {}", cache.shape(), rows.shape()),
            ));
        };
        let inner: usize = dims[op.dim + 1..].iter().product();
        let outer: usize = dims[..op.dim].iter().product();
        let width = cache.dtype().size();
        let (from, count) = op.rows_written(t);
        let fits = out.numel() == cache.numel()
            && rows.numel() == outer * t * inner
            && op.at + count <= len
            && from + count <= t
            && rows.dtype() == cache.dtype()
            && out.dtype() == cache.dtype()
            && matches!(width, 2 | 4 | 8);
        if !fits {
            return Err(device_error(
                name,
                format!(
                    "cache {} {}, rows {from}..{} of {} {} at {} along dim {}, output {} {}",
                    cache.dtype(),
                    cache.shape(),
                    from + count,
                    rows.dtype(),
                    rows.shape(),
                    op.at,
                    op.dim,
                    out.dtype(),
                    out.shape()
                ),
            ));
        }
        writes.push(RowsWrite {
            cache,
            rows,
            out,
            geometry: RowsGeometry {
                outer,
                len,
                t,
                inner,
                width,
                from,
                count,
            },
            in_place: out.ptr() == cache.ptr(),
        });
    }
    let listed = writes.first().is_some_and(|w| {
        writes
            .iter()
            .all(|x| x.in_place && x.geometry == w.geometry)
    });
    if listed {
        for chunk in writes.chunks(ROWS_TABLE) {
            write_listed(op, b, chunk)?;
        }
        return Ok(());
    }
    for w in &writes {
        write_one(op, b, w)?;
    }
    Ok(())
}

/// The rows of `writes` (at most [`ROWS_TABLE`], in place, of one geometry) in one launch.
fn write_listed(op: &WriteRows, b: &CudaKernels, writes: &[RowsWrite<'_>]) -> Result<()> {
    let name = op.name();
    let Some(g) = writes.first().map(|w| w.geometry) else {
        return Ok(());
    };
    let elements = g.outer * g.count * g.inner * writes.len();
    if elements == 0 {
        return Ok(());
    }
    let mut table = RowsTable {
        rows: [0; ROWS_TABLE],
        out: [0; ROWS_TABLE],
    };
    for (i, w) in writes.iter().enumerate() {
        table.rows[i] = w.rows.ptr();
        table.out[i] = w.out.ptr();
    }
    let rt = b.runtime();
    let f = SOURCE.function(rt, name, DecodeKernel::RowsTable(g.width))?;
    let c = writes.len() as i32;
    let geometry = g.args(op.at);
    let mut l = rt.launcher(name, f)?;
    l.arg(&table).arg(&c);
    for a in &geometry {
        l.arg(a);
    }
    // SAFETY: write_rows_table_b<width> takes (RowsTable by value, int caches, i64 outer,
    // i64 len, i64 t, i64 inner, i64 at, i64 from, i64 count) with E of the elements' width;
    // the first `caches` entries point at rows of outer * t * inner elements and caches (their
    // own memory) of outer * len * inner, at + count <= len and from + count <= t (checked by
    // the caller); the pieces outlive the launch.
    launched(name, unsafe { l.launch(grid(elements)) })
}

/// One cache's write: into its own memory only the rows move; else every element.
fn write_one(op: &WriteRows, b: &CudaKernels, w: &RowsWrite<'_>) -> Result<()> {
    let name = op.name();
    let g = w.geometry;
    let all = i32::from(!w.in_place);
    let elements = if w.in_place {
        g.outer * g.count * g.inner
    } else {
        w.cache.numel()
    };
    if elements == 0 {
        return Ok(());
    }
    let rt = b.runtime();
    let f = SOURCE.function(rt, name, DecodeKernel::Rows(g.width))?;
    let (cp, rp, op_) = (w.cache.ptr(), w.rows.ptr(), w.out.ptr());
    let geometry = g.args(op.at);
    let mut l = rt.launcher(name, f)?;
    l.arg(&cp).arg(&rp).arg(&op_);
    for a in &geometry {
        l.arg(a);
    }
    l.arg(&all);
    // SAFETY: write_rows_b<width> takes (const E*, const E*, E*, i64 outer, i64 len, i64 t,
    // i64 inner, i64 at, i64 from, i64 count, int all) with E of the elements' width; cache
    // and out hold outer * len * inner elements, rows outer * t * inner, at + count <= len and
    // from + count <= t (checked by the caller); the pieces outlive the launch.
    launched(name, unsafe { l.launch(grid(elements)) })
}
