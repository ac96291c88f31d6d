//! Matmul CUDA kernels: cuBLAS strided-batched gemm for f32 (at the op's precision), f64,
//! bf16 and f16 (16-bit in and out, f32 accumulation), either operand transposed by cuBLAS's
//! operation flags; an NVRTC kernel for i64
//! (transposed operands copied first). A product plus an accumulator is one cuBLASLt product
//! reading it as C where cuBLASLt serves the types, else the product and an add.

use std::sync::Arc;

use oxiflow_dtype::{DType, MatmulPrecision};

use super::super::copy::fill;
use super::super::kernels::{grid, launch, Kernel};
use super::super::precision::{gemm, Gemm};
use super::super::storage::CudaStorage;
use super::super::{derr, CudaRuntime};
use super::layout::permute;
use super::CudaKernels;
use crate::blaslt::LtMatmul;
use oxiflow_tensor::backend::{ElementwiseKernels, MatmulKernels};
use oxiflow_tensor::BinaryOp;
use oxiflow_tensor::Result;

/// `out = op(a) op(b)` for `g` (`out` holds `batch * m * n` elements).
fn matmul(
    rt: &Arc<CudaRuntime>,
    op: &'static str,
    a: &CudaStorage,
    b: &CudaStorage,
    out: &CudaStorage,
    g: Gemm,
) -> Result<()> {
    if out.numel() != g.batch * g.m * g.n || out.dtype != a.dtype || b.dtype != a.dtype {
        return Err(derr(
            op,
            format!(
                "{} {} and {} {} do not multiply into {} {}",
                a.dtype, a.shape, b.dtype, b.shape, out.dtype, out.shape
            ),
        ));
    }
    if g.batch * g.m * g.n == 0 {
        return Ok(());
    }
    if g.k == 0 {
        return fill(rt, op, a.dtype, out.ptr(), out.numel(), 0.0, 0);
    }
    match a.dtype {
        DType::I64 => {
            if g.ta || g.tb {
                let t = |x: &CudaStorage| -> Result<CudaStorage> {
                    let n = x.shape.ndim();
                    let mut perm: Vec<usize> = (0..n).collect();
                    perm.swap(n - 2, n - 1);
                    permute(rt, x, &perm)
                };
                let a2 = if g.ta { t(a)? } else { a.clone() };
                let b2 = if g.tb { t(b)? } else { b.clone() };
                let plain = Gemm {
                    ta: false,
                    tb: false,
                    ..g
                };
                return matmul(rt, op, &a2, &b2, out, plain);
            }
            let (bt, m_, k_, n_, sbb, ap, bp, yp) = (
                g.batch as i64,
                g.m as i64,
                g.k as i64,
                g.n as i64,
                g.strides.1,
                a.ptr(),
                b.ptr(),
                out.ptr(),
            );
            launch!(rt, op, Kernel::MatmulI64, grid(g.batch * g.m * g.n); bt, m_, k_, n_, sbb, ap, bp, yp)?;
        }
        DType::F32 | DType::F64 | DType::BF16 | DType::F16 => gemm(rt, op, a, b, out, g)?,
    }
    Ok(())
}

/// The gemm of [`CudaKernels::product_t`]'s operands (sizes and strides, f32 products in f32;
/// errors where they do not multiply).
fn product_shape(
    name: &'static str,
    a: &CudaStorage,
    b: &CudaStorage,
    (ta, tb): (bool, bool),
    batched: bool,
    out: &CudaStorage,
) -> Result<Gemm> {
    let (ad, bd) = (a.shape.dims(), b.shape.dims());
    let bad = || {
        derr(
            name,
            format!(
                "local pieces {} and {} do not multiply (transposed: {ta}, {tb})",
                a.shape, b.shape
            ),
        )
    };
    let (r, rb) = (ad.len(), bd.len());
    if rb < 2 || r < 1 || (batched && (r != rb || ad[..r - 2] != bd[..rb - 2])) {
        return Err(bad());
    }
    if !batched && (rb != 2 || (ta && r != 2)) {
        return Err(bad());
    }
    let (bk, bn) = if tb {
        (bd[rb - 1], bd[rb - 2])
    } else {
        (bd[rb - 2], bd[rb - 1])
    };
    let (batch, m, kk) = if batched {
        let (m, kk) = if ta {
            (ad[r - 1], ad[r - 2])
        } else {
            (ad[r - 2], ad[r - 1])
        };
        (ad[..r - 2].iter().product::<usize>(), m, kk)
    } else if ta {
        (1, ad[1], ad[0])
    } else {
        let kk = ad[r - 1];
        // m from the output when k is 0 (a holds no elements then).
        let m = a
            .numel()
            .checked_div(kk)
            .unwrap_or_else(|| out.numel() / bn.max(1));
        (1, m, kk)
    };
    if kk != bk {
        return Err(bad());
    }
    Ok(Gemm {
        batch,
        m,
        k: kk,
        n: bn,
        ta,
        tb,
        strides: (
            (m * kk) as i64,
            if batched { (kk * bn) as i64 } else { 0 },
            (m * bn) as i64,
        ),
        precision: MatmulPrecision::F32,
    })
}

impl CudaKernels {
    /// `op(a) @ op(b)` on device pieces into `out` (see `MatmulKernels::matmul_t`), for the
    /// other kernels: the product of `a` (`[.., m, k]`, or `[.., k, m]` with `ta`) and `b`
    /// (`[.., k, n]`, or `[.., n, k]` with `tb`), batched over equal leading dims when
    /// `batched`, else `b` 2-d and every leading dim of `a` folded into m; f32 operands at
    /// `precision`.
    #[allow(clippy::too_many_arguments)]
    pub(super) fn product_t(
        &self,
        name: &'static str,
        a: &CudaStorage,
        b: &CudaStorage,
        t: (bool, bool),
        batched: bool,
        precision: MatmulPrecision,
        out: &CudaStorage,
    ) -> Result<()> {
        let g = product_shape(name, a, b, t, batched, out)?;
        matmul(&self.rt, name, a, b, out, Gemm { precision, ..g })
    }
}

impl MatmulKernels for CudaKernels {
    fn matmul(
        &self,
        a: &CudaStorage,
        b: &CudaStorage,
        precision: MatmulPrecision,
        out: &mut CudaStorage,
    ) -> Result<()> {
        self.product_t("matmul", a, b, (false, false), false, precision, out)
    }

    fn batch_matmul(
        &self,
        a: &CudaStorage,
        b: &CudaStorage,
        precision: MatmulPrecision,
        out: &mut CudaStorage,
    ) -> Result<()> {
        let t = (false, false);
        self.product_t("batch_matmul", a, b, t, true, precision, out)
    }

    fn matmul_t(
        &self,
        a: &CudaStorage,
        b: &CudaStorage,
        t: (bool, bool),
        batched: bool,
        precision: MatmulPrecision,
        out: &mut CudaStorage,
    ) -> Result<()> {
        let name = if batched {
            "batch_matmul_t"
        } else {
            "matmul_t"
        };
        self.product_t(name, a, b, t, batched, precision, out)
    }

    fn matmul_t_acc(
        &self,
        a: &CudaStorage,
        b: &CudaStorage,
        t: (bool, bool),
        batched: bool,
        c: &CudaStorage,
        precision: MatmulPrecision,
        out: &mut CudaStorage,
    ) -> Result<()> {
        let name = "matmul_t_acc";
        super::fits_as(
            name,
            c,
            out,
            true,
            ("the accumulator", "is not the product's"),
        )?;
        let g = Gemm {
            precision,
            ..product_shape(name, a, b, t, batched, out)?
        };
        // One cuBLASLt product reading c as its C operand (beta = 1).
        let lt = self.lt_types(a.dtype, precision).filter(|_| {
            g.batch == 1 && g.m * g.n * g.k > 0 && a.dtype == b.dtype && a.dtype == out.dtype
        });
        if let Some(types) = lt {
            let p = LtMatmul {
                beta: 1.0,
                ..LtMatmul::new((g.m, g.n, g.k), t, types)
            };
            if self.lt_ran_c(&p, a.ptr(), b.ptr(), c.ptr(), out.ptr())? {
                return Ok(());
            }
        }
        matmul(&self.rt, name, a, b, out, g)?;
        let product = out.clone();
        self.binary(BinaryOp::Add, &product, c, out)
    }
}
