//! The `Tensor` methods of the matmul family (`op/matmul.rs`): they build its ops
//! and dispatch them. The plain methods multiply f32 operands in f32; the `_at` ones at a
//! given [`MatmulPrecision`] (a layer's, from its precision policy).

use oxiflow_dtype::MatmulPrecision;

use crate::dispatch::dispatch;
use crate::op::{MatmulOp, MatmulProduct};
use crate::tensor::Tensor;
use crate::Result;

impl Tensor {
    /// Matrix product. `b` 2-d: `self [.., k] @ b [k, n]`; otherwise batch matmul with equal
    /// batch dims.
    pub fn matmul(&self, b: &Tensor) -> Result<Tensor> {
        self.matmul_at(b, MatmulPrecision::F32)
    }
    /// [`Tensor::matmul`] with f32 operands multiplied at `precision` on a device.
    pub fn matmul_at(&self, b: &Tensor, precision: MatmulPrecision) -> Result<Tensor> {
        let product = if b.ndim() == 2 {
            MatmulProduct::MatMul
        } else {
            MatmulProduct::BatchMatMul
        };
        dispatch(MatmulOp::new(product, precision).into(), &[self, b])
    }
    /// Batch matmul `[b.., m, k] @ [b.., k, n]`.
    pub fn bmm(&self, b: &Tensor) -> Result<Tensor> {
        self.bmm_at(b, MatmulPrecision::F32)
    }
    /// [`Tensor::bmm`] with f32 operands multiplied at `precision` on a device.
    pub fn bmm_at(&self, b: &Tensor, precision: MatmulPrecision) -> Result<Tensor> {
        dispatch(
            MatmulOp::new(MatmulProduct::BatchMatMul, precision).into(),
            &[self, b],
        )
    }
    /// `op(self) @ op(b)`, op transposing the last two dims when `ta` / `tb` is set, without
    /// materialising the transposes. `b` 2-d: `self [.., m, k]` (or `[k, m]` 2-d with `ta`);
    /// otherwise a batch product with equal batch dims.
    pub fn matmul_t(&self, b: &Tensor, ta: bool, tb: bool) -> Result<Tensor> {
        self.matmul_t_at(b, (ta, tb), MatmulPrecision::F32)
    }
    /// [`Tensor::matmul_t`] with f32 operands multiplied at `precision` on a device.
    pub fn matmul_t_at(
        &self,
        b: &Tensor,
        (ta, tb): (bool, bool),
        precision: MatmulPrecision,
    ) -> Result<Tensor> {
        let product = if b.ndim() == 2 {
            MatmulProduct::MatMulT { ta, tb }
        } else {
            MatmulProduct::BatchMatMulT { ta, tb }
        };
        dispatch(MatmulOp::new(product, precision).into(), &[self, b])
    }
    /// `op(self) @ op(b) + acc` (see [`Tensor::matmul_t`]; `acc` has the product's shape and
    /// dtype, and takes the product's SBP). On CUDA one cuBLASLt product reading `acc` as
    /// its C operand where the types allow; a product, then an add, elsewhere.
    pub fn matmul_t_acc(&self, b: &Tensor, ta: bool, tb: bool, acc: &Tensor) -> Result<Tensor> {
        self.matmul_t_acc_at(b, (ta, tb), acc, MatmulPrecision::F32)
    }
    /// [`Tensor::matmul_t_acc`] with f32 operands multiplied at `precision` on a device.
    pub fn matmul_t_acc_at(
        &self,
        b: &Tensor,
        (ta, tb): (bool, bool),
        acc: &Tensor,
        precision: MatmulPrecision,
    ) -> Result<Tensor> {
        let batched = b.ndim() != 2;
        let product = MatmulProduct::MatMulTAcc { ta, tb, batched };
        dispatch(MatmulOp::new(product, precision).into(), &[self, b, acc])
    }
}
