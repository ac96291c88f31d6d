//! The `Tensor` methods of the matmul family (`op/matmul.rs`): they build its ops
//! and dispatch them.

use crate::dispatch::dispatch;
use crate::op::MatmulOp;
use crate::tensor::Tensor;
use crate::Result;

impl Tensor {
    /// Matrix product. `b` 2-d: `self [.., k] @ b [k, n]`; otherwise batch matmul with equal
    /// batch dims.
    pub fn matmul(&self, b: &Tensor) -> Result<Tensor> {
        if b.ndim() != 2 {
            return self.bmm(b);
        }
        dispatch(MatmulOp::MatMul.into(), &[self, b])
    }
    /// Batch matmul `[b.., m, k] @ [b.., k, n]`.
    pub fn bmm(&self, b: &Tensor) -> Result<Tensor> {
        dispatch(MatmulOp::BatchMatMul.into(), &[self, b])
    }
    /// `op(self) @ op(b)`, op transposing the last two dims when `ta` / `tb` is set, without
    /// materialising the transposes. `b` 2-d: `self [.., m, k]` (or `[k, m]` 2-d with `ta`);
    /// otherwise a batch product with equal batch dims.
    pub fn matmul_t(&self, b: &Tensor, ta: bool, tb: bool) -> Result<Tensor> {
        let op = if b.ndim() == 2 {
            MatmulOp::MatMulT { ta, tb }
        } else {
            MatmulOp::BatchMatMulT { ta, tb }
        };
        dispatch(op.into(), &[self, b])
    }
    /// `op(self) @ op(b) + acc` (see [`Tensor::matmul_t`]; `acc` has the product's shape and
    /// dtype, and takes the product's SBP). On CUDA one cuBLASLt product reading `acc` as
    /// its C operand where the types allow; a product, then an add, elsewhere.
    pub fn matmul_t_acc(&self, b: &Tensor, ta: bool, tb: bool, acc: &Tensor) -> Result<Tensor> {
        let batched = b.ndim() != 2;
        dispatch(
            MatmulOp::MatMulTAcc { ta, tb, batched }.into(),
            &[self, b, acc],
        )
    }
}
