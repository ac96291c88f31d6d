//! The rotary embedding by tables: x `[B, T, H, D]` rotated as `x cos + rotate_half(x) sin` by
//! cos and sin tables `[T, 1, D]` of its rows' positions (GPT-NeoX layout: `rotate_half(x) =
//! [-x2, x1]` over the halves of D), in one fused kernel; the backward is the transposed
//! rotation of the output's gradient, `[g1 c1 + g2 s2, g2 c2 - g1 s1]` (the op with
//! `inverse`). The tables may hold any positions in any order (a context-parallel rank's
//! load-balanced rows, scaled frequencies); they share x's dtype and take no gradient.
//!
//! Layouts (`oxiflow_sbp::rules::rotary_tables`): the batch or the heads split with whole
//! tables, the rows split with the tables' rows split alike, all whole, or a partial x (the
//! rotation is linear in it). Kernels: CPU in f32, f64 and bf16 (computed in f32, rounded
//! once), CUDA in f32, f64, bf16 and f16 (`rotary.cu`); any other backend or dtype is
//! `TensorError::NoKernel` on every rank before anything runs.

mod cpu;
mod cuda;

use std::sync::LazyLock;

use oxiflow_dtype::DType;
use oxiflow_sbp::{rules, RuleMode, Shape};
use oxiflow_tensor::{
    dispatch, Extern, ExternOp, Grad, Inferred, Kernels, MetaError, MetaResult, Result, Tensor,
};

use crate::op_signature::kernels_saving_inputs;
use crate::operand_dtypes::{float_kernels, one_float_dtype};

/// x rotated by cos and sin tables (inputs: x, cos, sin); `inverse`: the transposed rotation.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct RotaryTables {
    pub inverse: bool,
}

/// x `[B, T, H, D]` rotated by the tables `cos` and `sin` `[T, 1, D]` of its rows' positions
/// (see the module docs; local or global alike).
pub fn rotary_tables(x: &Tensor, cos: &Tensor, sin: &Tensor) -> Result<Tensor> {
    dispatch(
        Extern::new(RotaryTables { inverse: false }).into(),
        &[x, cos, sin],
    )
}

static KERNELS: LazyLock<Kernels> =
    LazyLock::new(|| float_kernels::<RotaryTables>(cpu::rotate, cuda::rotate));

impl ExternOp for RotaryTables {
    fn name(&self) -> &'static str {
        if self.inverse {
            "rotary_tables_backward"
        } else {
            "rotary_tables"
        }
    }
    fn attrs(&self, key: &mut Vec<u8>) {
        key.push(u8::from(self.inverse));
    }
    fn arity(&self) -> (usize, usize) {
        (3, 3)
    }
    fn infer(&self, shapes: &[&Shape], dtypes: &[DType], mode: RuleMode) -> MetaResult<Inferred> {
        let dt = one_float_dtype(dtypes)?;
        if shapes[1] != shapes[2] {
            return Err(MetaError::Shape(format!(
                "the cos table {} and the sin table {} differ",
                shapes[1], shapes[2]
            )));
        }
        let r = rules::rotary_tables(shapes[0], shapes[1], mode).map_err(MetaError::Shape)?;
        Ok(Inferred::new(r, dt))
    }
    kernels_saving_inputs!(KERNELS, [1, 2]);
    fn no_gradient(&self) -> Option<&'static str> {
        self.inverse
            .then_some("the rotary embedding's backward has no gradient here")
    }
    fn backward(&self, g: &Grad<'_>) -> Result<Vec<Option<Tensor>>> {
        if g.need(1) || g.need(2) {
            return Err(Grad::unsupported(
                self.name(),
                "the cos and sin tables take no gradient",
            ));
        }
        let op = Extern::new(RotaryTables { inverse: true });
        let dx = dispatch(op.into(), &[g.dy()?, g.input(1)?, g.input(2)?])?;
        Ok(vec![g.need(0).then_some(dx), None, None])
    }
}
