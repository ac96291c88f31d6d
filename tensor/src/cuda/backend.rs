//! `CudaBackend`: the device seam's `DeviceBackend` for CUDA: uploads and the local kernel of
//! every dispatched op on device pieces (NVRTC kernels, cuBLAS for f32/f64 matmul).

use std::sync::Arc;

use cudarc::cublas::sys::cublasOperation_t::CUBLAS_OP_N;
use oxiflow_collectives::DType;
use oxiflow_sbp::{Region, Shape};

use super::copy::{copy_nd, fill};
use super::kernels::{grid, launch, per_row, sfx, strides, Nd};
use super::precision::{gemm_bf16, MatmulPrecision};
use super::storage::CudaStorage;
use super::{derr, runtime, CudaRuntime};
use crate::creation::ElementInit;
use crate::device::{DeviceBackend, DeviceStorage};
use crate::op::{BinaryOp, Op, ScalarOp, UnaryOp};
use crate::storage::{CpuArray, Storage};
use crate::Result;

/// The CUDA backend (stateless: the process's runtime holds the device state).
#[derive(Clone, Copy, Debug, Default)]
pub struct CudaBackend;

/// The CUDA piece inside a storage, or a typed error naming `op`.
pub(crate) fn cuda_of<'a>(op: &'static str, s: &'a Storage) -> Result<&'a CudaStorage> {
    match s {
        Storage::Device(d) => d
            .as_any()
            .downcast_ref::<CudaStorage>()
            .ok_or_else(|| derr(op, format!("piece on {} is not CUDA storage", d.device()))),
        Storage::Cpu(_) => Err(derr(op, "expected a CUDA piece, got host storage")),
    }
}

fn wrap(s: CudaStorage) -> Storage {
    Storage::Device(Arc::new(s))
}

fn permute(rt: &Arc<CudaRuntime>, x: &CudaStorage, perm: &[usize]) -> Result<CudaStorage> {
    let d = x.shape.dims();
    let st = strides(d);
    let out_dims: Vec<usize> = perm.iter().map(|&p| d[p]).collect();
    let src_st: Vec<i64> = perm.iter().map(|&p| st[p]).collect();
    let out = CudaStorage::alloc(rt, x.dtype, Shape::from(out_dims.as_slice()))?;
    copy_nd(
        rt,
        "permute",
        x.dtype,
        &out_dims,
        x.ptr(),
        0,
        &src_st,
        out.ptr(),
        0,
        &strides(&out_dims),
        0,
    )?;
    Ok(out)
}

/// Sum (or max) over `dims`, times `scale`; output keeps reduced dims as 1 when `keepdim`.
fn reduce(
    rt: &Arc<CudaRuntime>,
    op: &'static str,
    x: &CudaStorage,
    dims: &[usize],
    keepdim: bool,
    max: bool,
    scale: f64,
) -> Result<CudaStorage> {
    let d = x.shape.dims();
    let mut red: Vec<usize> = dims.to_vec();
    red.sort_unstable();
    red.dedup();
    let keep: Vec<usize> = (0..d.len()).filter(|i| !red.contains(i)).collect();
    let perm: Vec<usize> = keep.iter().chain(red.iter()).copied().collect();
    let rows: usize = keep.iter().map(|&i| d[i]).product();
    let len: usize = red.iter().map(|&i| d[i]).product();
    let out_dims: Vec<usize> = if keepdim {
        (0..d.len())
            .map(|i| if red.contains(&i) { 1 } else { d[i] })
            .collect()
    } else {
        keep.iter().map(|&i| d[i]).collect()
    };
    let out = CudaStorage::alloc(rt, x.dtype, Shape::from(out_dims.as_slice()))?;
    if rows == 0 {
        return Ok(out);
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
        max as i32,
        scale,
        src.ptr(),
        out.ptr(),
    );
    let name = format!("reduce_rows_{}", sfx(x.dtype));
    launch!(rt, op, name, per_row(rows); r, l, mx, sc, xp, yp)?;
    Ok(out)
}

fn unary_code(u: UnaryOp) -> i32 {
    match u {
        UnaryOp::Neg => 0,
        UnaryOp::Relu => 1,
        UnaryOp::Gelu => 2,
        UnaryOp::Exp => 3,
        UnaryOp::Log => 4,
        UnaryOp::Tanh => 5,
        UnaryOp::Sigmoid => 6,
        UnaryOp::Sqrt => 7,
        UnaryOp::Abs => 8,
        UnaryOp::Square => 9,
    }
}

fn float_only(op: &'static str, d: DType) -> Result<()> {
    if d == DType::I64 {
        return Err(derr(op, "needs a float input, got i64"));
    }
    Ok(())
}

/// (outer, n, inner) of `dim` in `shape`.
fn lanes(shape: &Shape, dim: usize) -> (usize, usize, usize) {
    let d = shape.dims();
    let outer: usize = d.iter().take(dim).product();
    let inner: usize = d.iter().skip(dim + 1).product();
    (outer, d.get(dim).copied().unwrap_or(1), inner)
}

#[allow(clippy::too_many_arguments)]
fn matmul(
    rt: &Arc<CudaRuntime>,
    op: &'static str,
    a: &CudaStorage,
    b: &CudaStorage,
    batch: usize,
    m: usize,
    k: usize,
    n: usize,
    out_shape: &Shape,
    b_batched: bool,
) -> Result<CudaStorage> {
    let out = CudaStorage::alloc(rt, a.dtype, out_shape.clone())?;
    if batch * m * n == 0 {
        return Ok(out);
    }
    if k == 0 {
        fill(rt, op, a.dtype, out.ptr(), out.numel(), 0.0, 0)?;
        return Ok(out);
    }
    let (sa, sb, sc) = (
        (m * k) as i64,
        if b_batched { (k * n) as i64 } else { 0 },
        (m * n) as i64,
    );
    let (mi, ni, ki) = (m as i32, n as i32, k as i32);
    match a.dtype {
        DType::I64 => {
            let (bt, m_, k_, n_, sbb, ap, bp, yp) = (
                batch as i64,
                m as i64,
                k as i64,
                n as i64,
                sb,
                a.ptr(),
                b.ptr(),
                out.ptr(),
            );
            launch!(rt, op, "matmul_i64", grid(batch * m * n); bt, m_, k_, n_, sbb, ap, bp, yp)?;
        }
        DType::F32 if rt.matmul_precision() == MatmulPrecision::Bf16 => {
            gemm_bf16(rt, op, a, b, &out, [batch, m, k, n], (sa, sb, sc))?
        }
        // Row-major C = A B is column-major C^T = B^T A^T: gemm(n, m, k, B, A).
        DType::F32 => rt.with_blas(op, |h| {
            let (one, zero) = (1.0f32, 0.0f32);
            // SAFETY: pointers are live device blocks of the sizes the strides describe.
            unsafe {
                cudarc::cublas::result::sgemm_strided_batched(
                    *h.handle(),
                    CUBLAS_OP_N,
                    CUBLAS_OP_N,
                    ni,
                    mi,
                    ki,
                    &one,
                    b.ptr() as *const f32,
                    ni,
                    sb,
                    a.ptr() as *const f32,
                    ki,
                    sa,
                    &zero,
                    out.ptr() as *mut f32,
                    ni,
                    sc,
                    batch as i32,
                )
            }
            .map_err(|e| derr(op, format!("cuBLAS sgemm: {e}")))
        })?,
        DType::F64 => rt.with_blas(op, |h| {
            let (one, zero) = (1.0f64, 0.0f64);
            // SAFETY: as above.
            unsafe {
                cudarc::cublas::result::dgemm_strided_batched(
                    *h.handle(),
                    CUBLAS_OP_N,
                    CUBLAS_OP_N,
                    ni,
                    mi,
                    ki,
                    &one,
                    b.ptr() as *const f64,
                    ni,
                    sb,
                    a.ptr() as *const f64,
                    ki,
                    sa,
                    &zero,
                    out.ptr() as *mut f64,
                    ni,
                    sc,
                    batch as i32,
                )
            }
            .map_err(|e| derr(op, format!("cuBLAS dgemm: {e}")))
        })?,
    }
    Ok(out)
}

impl DeviceBackend for CudaBackend {
    fn from_host(&self, array: &CpuArray, _ordinal: usize) -> Result<Arc<dyn DeviceStorage>> {
        // One device per process: every ordinal maps to the bound device.
        Ok(Arc::new(CudaStorage::from_host(array)?))
    }

    fn creates(&self, _init: ElementInit, _dtype: DType) -> bool {
        true
    }

    fn create(
        &self,
        init: ElementInit,
        dtype: DType,
        shape: &Shape,
        region: &Region,
        zero: bool,
        _ordinal: usize,
    ) -> Result<Arc<dyn DeviceStorage>> {
        super::create::create(init, dtype, shape, region, zero)
    }

    fn run(
        &self,
        op: &Op,
        inputs: &[&Storage],
        out_shape: &Shape,
        out_dtype: DType,
    ) -> Result<Storage> {
        let name = op.name();
        let rt = runtime(name)?;
        let mut x: Vec<&CudaStorage> = Vec::with_capacity(inputs.len());
        for s in inputs {
            x.push(cuda_of(name, s)?);
        }
        let arity = match op {
            Op::Concat { .. } => 1,
            Op::LayerNorm { .. } | Op::CrossEntropyBackward | Op::LayerNormBackward { .. } => 3,
            Op::Binary(_)
            | Op::MatMul
            | Op::BatchMatMul
            | Op::Embedding
            | Op::CrossEntropy
            | Op::UnaryBackward(_)
            | Op::SoftmaxBackward { .. }
            | Op::LogSoftmaxBackward { .. }
            | Op::EmbeddingBackward { .. } => 2,
            _ => 1,
        };
        if x.len() < arity {
            return Err(derr(name, format!("{} input(s), {arity} needed", x.len())));
        }
        let a = x[0];
        let dt = a.dtype;
        let n = a.numel();
        let new = |shape: &Shape, dtype: DType| CudaStorage::alloc(&rt, dtype, shape.clone());
        let out = match op {
            Op::Unary(u) => {
                let y = new(out_shape, dt)?;
                let (nn, code, xp, yp) = (n as i64, unary_code(*u), a.ptr(), y.ptr());
                if dt == DType::I64 {
                    if !matches!(
                        u,
                        UnaryOp::Neg | UnaryOp::Relu | UnaryOp::Abs | UnaryOp::Square
                    ) {
                        return Err(derr(name, "needs a float input, got i64"));
                    }
                    launch!(rt, name, "unary_i64", grid(n); nn, code, xp, yp)?;
                } else if n > 0 {
                    launch!(rt, name, format!("unary_{}", sfx(dt)), grid(n); nn, code, xp, yp)?;
                }
                y
            }
            Op::Scalar(s, c) => {
                let code: i32 = match s {
                    ScalarOp::Add => 0,
                    ScalarOp::Mul => 1,
                    ScalarOp::RSub => 2,
                    ScalarOp::RDiv => 3,
                    ScalarOp::Pow => 4,
                };
                if dt == DType::I64 && code > 2 {
                    return Err(derr(name, "needs a float input, got i64"));
                }
                let y = new(out_shape, dt)?;
                let (nn, cv, xp, yp) = (n as i64, c.get(), a.ptr(), y.ptr());
                if n > 0 {
                    launch!(rt, name, format!("scalar_{}", sfx(dt)), grid(n); nn, code, cv, xp, yp)?;
                }
                y
            }
            Op::Binary(b) => {
                if dt == DType::I64 && *b == BinaryOp::Div {
                    return Err(derr(name, "integer division is not supported on cuda"));
                }
                if x[1].dtype != dt {
                    return Err(derr(name, format!("dtypes {} and {}", dt, x[1].dtype)));
                }
                let od = out_shape.dims();
                if a.shape.ndim() > od.len() || x[1].shape.ndim() > od.len() {
                    return Err(derr(
                        name,
                        format!(
                            "{} and {} do not broadcast to {out_shape}",
                            a.shape, x[1].shape
                        ),
                    ));
                }
                let bstr = |s: &CudaStorage| -> Vec<i64> {
                    let sd = s.shape.dims();
                    let st = strides(sd);
                    let lead = od.len() - sd.len();
                    (0..od.len())
                        .map(|i| {
                            if i < lead || sd[i - lead] == 1 {
                                0
                            } else {
                                st[i - lead]
                            }
                        })
                        .collect()
                };
                let (sa, sb) = (bstr(a), bstr(x[1]));
                let p = Nd::new(od, &sa, &sb)
                    .ok_or_else(|| derr(name, "more than 8 broadcast dims"))?;
                let y = new(out_shape, dt)?;
                let code: i32 = match b {
                    BinaryOp::Add => 0,
                    BinaryOp::Sub => 1,
                    BinaryOp::Mul => 2,
                    BinaryOp::Div => 3,
                };
                let m = y.numel();
                let (nn, ap, bp, yp) = (m as i64, a.ptr(), x[1].ptr(), y.ptr());
                if m > 0 {
                    launch!(rt, name, format!("binary_{}", sfx(dt)), grid(m); nn, code, p, ap, bp, yp)?;
                }
                y
            }
            Op::Cast(to) => {
                if *to == dt {
                    a.clone()
                } else {
                    let y = new(out_shape, *to)?;
                    let (nn, xp, yp) = (n as i64, a.ptr(), y.ptr());
                    if n > 0 {
                        launch!(rt, name, format!("cast_{}_{}", sfx(dt), sfx(*to)), grid(n); nn, xp, yp)?;
                    }
                    y
                }
            }
            Op::MatMul => {
                let k = a.shape.dims().last().copied().unwrap_or(1);
                let bd = x[1].shape.dims();
                if bd.len() != 2 || bd[0] != k {
                    return Err(derr(
                        name,
                        format!(
                            "local pieces {} and {} do not multiply",
                            a.shape, x[1].shape
                        ),
                    ));
                }
                let m = n
                    .checked_div(k)
                    .unwrap_or_else(|| out_shape.numel() / bd[1].max(1));
                matmul(&rt, name, a, x[1], 1, m, k, bd[1], out_shape, false)?
            }
            Op::BatchMatMul => {
                let ad = a.shape.dims();
                let bd = x[1].shape.dims();
                if ad.len() < 2 || bd.len() != ad.len() || bd[ad.len() - 2] != ad[ad.len() - 1] {
                    return Err(derr(
                        name,
                        format!(
                            "local pieces {} and {} do not multiply",
                            a.shape, x[1].shape
                        ),
                    ));
                }
                let r = ad.len();
                let batch: usize = ad[..r - 2].iter().product();
                matmul(
                    &rt,
                    name,
                    a,
                    x[1],
                    batch,
                    ad[r - 2],
                    ad[r - 1],
                    bd[r - 1],
                    out_shape,
                    true,
                )?
            }
            Op::Sum { dims, keepdim } => reduce(&rt, name, a, dims, *keepdim, false, 1.0)?,
            Op::Max { dims, keepdim } => reduce(&rt, name, a, dims, *keepdim, true, 1.0)?,
            Op::Mean {
                dims,
                keepdim,
                count,
            } => {
                float_only(name, dt)?;
                let count = if *count == 0 {
                    dims.iter().map(|&d| a.shape.dim(d)).product::<usize>()
                } else {
                    *count
                };
                reduce(&rt, name, a, dims, *keepdim, false, 1.0 / count as f64)?
            }
            Op::SumToShape { shape } => {
                let s = a.shape.dims();
                let t = shape.dims();
                let lead = s.len().saturating_sub(t.len());
                let dims: Vec<usize> = (0..s.len())
                    .filter(|&d| d < lead || (t[d - lead] == 1 && s[d] != 1))
                    .collect();
                reduce(&rt, name, a, &dims, true, false, 1.0)?.reshaped(shape.clone())
            }
            Op::Softmax { dim } | Op::LogSoftmax { dim } => {
                float_only(name, dt)?;
                let (o, len, inner) = lanes(&a.shape, *dim);
                let y = new(out_shape, dt)?;
                let (l, nn, inn, lg, xp, yp) = (
                    (o * inner) as i64,
                    len as i64,
                    inner as i64,
                    matches!(op, Op::LogSoftmax { .. }) as i32,
                    a.ptr(),
                    y.ptr(),
                );
                if o * inner > 0 {
                    launch!(rt, name, format!("softmax_{}", sfx(dt)), grid(o * inner); l, nn, inn, lg, xp, yp)?;
                }
                y
            }
            Op::SoftmaxBackward { dim } | Op::LogSoftmaxBackward { dim } => {
                float_only(name, dt)?;
                // inputs: (y, dy)
                let (o, len, inner) = lanes(&a.shape, *dim);
                let y = new(out_shape, dt)?;
                let lg = matches!(op, Op::LogSoftmaxBackward { .. }) as i32;
                let (l, nn, inn, yp, gp, dp) = (
                    (o * inner) as i64,
                    len as i64,
                    inner as i64,
                    a.ptr(),
                    x[1].ptr(),
                    y.ptr(),
                );
                if o * inner > 0 {
                    launch!(rt, name, format!("softmax_bw_{}", sfx(dt)), grid(o * inner); l, nn, inn, lg, yp, gp, dp)?;
                }
                y
            }
            Op::UnaryBackward(u) => {
                float_only(name, dt)?;
                // inputs: (dy, x)
                let y = new(out_shape, dt)?;
                let (nn, code, gp, xp, yp) =
                    (n as i64, unary_code(*u), a.ptr(), x[1].ptr(), y.ptr());
                if n > 0 {
                    launch!(rt, name, format!("unary_bw_{}", sfx(dt)), grid(n); nn, code, gp, xp, yp)?;
                }
                y
            }
            Op::Permute { perm } => permute(&rt, a, perm)?,
            Op::Reshape { shape } => {
                if shape.numel() != n {
                    return Err(derr(
                        name,
                        format!("cannot reshape local piece {} to {shape}", a.shape),
                    ));
                }
                a.reshaped(shape.clone())
            }
            Op::Narrow { dim, start, len } => {
                let d = a.shape.dims();
                if *dim >= d.len() || start + len > d[*dim] {
                    return Err(derr(
                        name,
                        format!(
                            "range {start}..{} out of local piece {} dim {dim}",
                            start + len,
                            a.shape
                        ),
                    ));
                }
                let st = strides(d);
                let mut bx = d.to_vec();
                bx[*dim] = *len;
                let y = new(out_shape, dt)?;
                copy_nd(
                    &rt,
                    name,
                    dt,
                    &bx,
                    a.ptr(),
                    start * st[*dim] as usize,
                    &st,
                    y.ptr(),
                    0,
                    &strides(&bx),
                    0,
                )?;
                y
            }
            Op::Concat { dim } => {
                let y = new(out_shape, dt)?;
                let od = out_shape.dims();
                let ost = strides(od);
                let mut at = 0usize;
                for p in &x {
                    let pd = p.shape.dims();
                    if p.dtype != dt || pd.len() != od.len() {
                        return Err(derr(
                            name,
                            format!("local pieces do not concatenate along dim {dim}"),
                        ));
                    }
                    copy_nd(
                        &rt,
                        name,
                        dt,
                        pd,
                        p.ptr(),
                        0,
                        &strides(pd),
                        y.ptr(),
                        at * ost[*dim] as usize,
                        &ost,
                        0,
                    )?;
                    at += pd[*dim];
                }
                y
            }
            Op::Embedding => {
                // inputs: (ids, weight [V, H])
                let w = x[1];
                let wd = w.shape.dims();
                if a.dtype != DType::I64 || wd.len() != 2 {
                    return Err(derr(name, "needs i64 ids and a 2-d float weight"));
                }
                float_only(name, w.dtype)?;
                let y = new(out_shape, w.dtype)?;
                let (nn, h, v, ip, wp, yp) = (
                    n as i64,
                    wd[1] as i64,
                    wd[0] as i64,
                    a.ptr(),
                    w.ptr(),
                    y.ptr(),
                );
                if n * wd[1] > 0 {
                    launch!(rt, name, format!("embedding_{}", sfx(w.dtype)), grid(n * wd[1]); nn, h, v, ip, wp, yp)?;
                }
                y
            }
            Op::EmbeddingBackward { num } => {
                // inputs: (ids, dy [.., H])
                let g = x[1];
                float_only(name, g.dtype)?;
                let h = g.shape.dims().last().copied().unwrap_or(1);
                let y = new(out_shape, g.dtype)?;
                fill(&rt, name, g.dtype, y.ptr(), y.numel(), 0.0, 0)?;
                let (nn, hh, v, ip, gp, yp) =
                    (n as i64, h as i64, *num as i64, a.ptr(), g.ptr(), y.ptr());
                if n * h > 0 {
                    launch!(rt, name, format!("embedding_bw_{}", sfx(g.dtype)), grid(n * h); nn, hh, v, ip, gp, yp)?;
                }
                y
            }
            Op::LayerNorm { eps } => {
                float_only(name, dt)?;
                let h = a.shape.dims().last().copied().unwrap_or(1);
                let rows = n.checked_div(h).unwrap_or(0);
                let y = new(out_shape, dt)?;
                let (r, hh, e, xp, wp, bp, yp) = (
                    rows as i64,
                    h as i64,
                    eps.get(),
                    a.ptr(),
                    x[1].ptr(),
                    x[2].ptr(),
                    y.ptr(),
                );
                if rows > 0 {
                    launch!(rt, name, format!("layer_norm_{}", sfx(dt)), grid(rows); r, hh, e, xp, wp, bp, yp)?;
                }
                y
            }
            Op::LayerNormBackward { eps } => {
                // inputs: (x, weight, dy)
                float_only(name, dt)?;
                let h = a.shape.dims().last().copied().unwrap_or(1);
                let rows = n.checked_div(h).unwrap_or(0);
                let y = new(out_shape, dt)?;
                let (r, hh, e, xp, wp, gp, yp) = (
                    rows as i64,
                    h as i64,
                    eps.get(),
                    a.ptr(),
                    x[1].ptr(),
                    x[2].ptr(),
                    y.ptr(),
                );
                if rows > 0 {
                    launch!(rt, name, format!("layer_norm_bw_{}", sfx(dt)), grid(rows); r, hh, e, xp, wp, gp, yp)?;
                }
                y
            }
            Op::CrossEntropy => {
                // inputs: (logits [N, C], labels [N])
                float_only(name, dt)?;
                let c = a.shape.dims().last().copied().unwrap_or(1);
                let rows = n.checked_div(c).unwrap_or(0);
                let y = new(out_shape, dt)?;
                let (r, cc, xp, lp, yp) = (rows as i64, c as i64, a.ptr(), x[1].ptr(), y.ptr());
                if rows > 0 {
                    launch!(rt, name, format!("cross_entropy_{}", sfx(dt)), grid(rows); r, cc, xp, lp, yp)?;
                }
                y
            }
            Op::CrossEntropyBackward => {
                // inputs: (logits, labels, dy)
                float_only(name, dt)?;
                let c = a.shape.dims().last().copied().unwrap_or(1);
                let rows = n.checked_div(c).unwrap_or(0);
                let y = new(out_shape, dt)?;
                let (r, cc, xp, lp, gp, yp) = (
                    rows as i64,
                    c as i64,
                    a.ptr(),
                    x[1].ptr(),
                    x[2].ptr(),
                    y.ptr(),
                );
                if rows > 0 {
                    launch!(rt, name, format!("cross_entropy_bw_{}", sfx(dt)), grid(rows); r, cc, xp, lp, gp, yp)?;
                }
                y
            }
        };
        if out.shape != *out_shape || out.dtype != out_dtype {
            return Err(derr(
                name,
                format!(
                    "cuda kernel gave {} {} where {} {} was expected",
                    out.dtype, out.shape, out_dtype, out_shape
                ),
            ));
        }
        Ok(wrap(out))
    }
}
