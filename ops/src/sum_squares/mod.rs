//! Multi-tensor sum of squares: one op reads many float tensors (any float dtypes, any shapes)
//! and gives each one's sum of squared elements and their total, in f64. Each square is
//! rounded to f32 (f64 for f64 data), as AdamW's second moment squares a gradient, so a finite
//! value whose square overflows makes the sum infinite as it would make the optimizer state;
//! the squares are added in f64 in a fixed order (deterministic, no float atomics). What a
//! global norm of gradients needs in one or two launches instead of several per tensor. The
//! same pass in [`SumTerm::TimesZero`] mode sums `x * 0` instead, which is NaN exactly when an
//! element is NaN or infinite (a non-finite search that no overflow can fool).
//!
//! Layouts: a sum over a split tensor is a partial sum over its mesh axis, a broadcast one
//! counts once, and squares do not distribute over partial sums, so per mesh axis either every
//! input is split (on any dims: the outputs are partial sums, `P`) or every input is whole
//! (broadcast; a partial input is all-reduced first, and the outputs are `B`). The op's
//! candidates are all-B and, per mesh axis, "every input split" on the dims the caller's
//! layouts name ([`SumSquares::for_inputs`]); group tensors so that each mesh axis is split for
//! all of them or for none, and nothing is boxed but partial inputs.
//!
//! Kernels: CPU for every float dtype (`cpu.rs`), CUDA for every float dtype (`cuda.rs`, two
//! launches over the whole list; its per-block partial sums and the uploaded list are scratch
//! the executor allocates).

mod cpu;
mod cuda;

use std::sync::LazyLock;

use crate::op_signature::kernels_without_gradient;
use crate::operand_dtypes::cpu_and_cuda_scratch;
use oxiflow_dtype::DType;
use oxiflow_sbp::{rules, RuleMode, Shape};
use oxiflow_tensor::{
    dispatch_multi, no_grad, Extern, ExternOp, Inferred, Kernels, MetaError, MetaResult, NdSbp,
    Result, Sbp, Tensor, TensorError,
};

/// What each element adds to its tensor's sum.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum SumTerm {
    /// `x * x`.
    Square,
    /// `x * 0`: 0, or NaN when `x` is NaN or infinite.
    TimesZero,
}

/// The sums of `term` over each input: output 0 is f64 `[n]` (one sum per input, in order),
/// output 1 the f64 0-d total (the sum of output 0 in order).
#[derive(Clone, Debug, PartialEq, Eq, Hash)]
pub struct SumSquares {
    pub term: SumTerm,
    /// Split candidates: each lists one dim per input, the "every input split" SBP of one
    /// mesh axis (see the module docs).
    pub splits: Vec<Vec<usize>>,
}

const FLOATS: &[DType] = &[DType::F32, DType::F64, DType::BF16, DType::F16];

static KERNELS: LazyLock<Kernels> = LazyLock::new(|| {
    cpu_and_cuda_scratch::<SumSquares>(
        (FLOATS, cpu::sum_squares),
        (FLOATS, cuda::sum_squares, cuda::scratch),
    )
});

impl SumSquares {
    /// The op for `inputs` (all global on one placement, or all local): one split candidate
    /// per mesh axis on which every input is split, on the dims they are split on.
    pub fn for_inputs(term: SumTerm, inputs: &[&Tensor]) -> SumSquares {
        let mut splits: Vec<Vec<usize>> = Vec::new();
        let naxes = inputs
            .first()
            .and_then(|t| t.nd_sbp())
            .map_or(0, NdSbp::len);
        for axis in 0..naxes {
            let dims: Option<Vec<usize>> = inputs
                .iter()
                .map(
                    |t| match t.nd_sbp().and_then(|nd| nd.as_slice().get(axis)) {
                        Some(&Sbp::Split(d)) => Some(d),
                        _ => None,
                    },
                )
                .collect();
            if let Some(d) = dims {
                if !splits.contains(&d) {
                    splits.push(d);
                }
            }
        }
        SumSquares { term, splits }
    }
}

impl ExternOp for SumSquares {
    fn name(&self) -> &'static str {
        match self.term {
            SumTerm::Square => "sum_squares",
            SumTerm::TimesZero => "non_finite_sums",
        }
    }

    fn attrs(&self, key: &mut Vec<u8>) {
        key.push(self.term as u8);
        for dims in &self.splits {
            key.extend((dims.len() as u64).to_le_bytes());
            for &d in dims {
                key.extend((d as u64).to_le_bytes());
            }
        }
    }

    fn arity(&self) -> (usize, usize) {
        (1, usize::MAX)
    }

    fn infer(&self, s: &[&Shape], d: &[DType], mode: RuleMode) -> MetaResult<Inferred> {
        if let Some((i, dt)) = d.iter().enumerate().find(|(_, dt)| !dt.is_float()) {
            return Err(MetaError::DType(format!(
                "input {i} must be a float dtype, got {dt}"
            )));
        }
        let r = rules::sum_squares(s, &self.splits, mode);
        Ok(Inferred::outputs(r, &[DType::F64, DType::F64]))
    }

    kernels_without_gradient!(KERNELS, "a norm statistic has no gradient here");
}

/// Each input's sum and their total (see [`SumSquares`]).
#[derive(Clone, Debug)]
pub struct TensorSums {
    /// f64 `[n]`: one sum per input, in order.
    pub each: Tensor,
    /// f64 0-d: the sum of `each`.
    pub total: Tensor,
}

/// The sum of the squared elements of each of `tensors` and their total, in f64, with one op
/// (all global on one placement, or all local on one device; at least one). Global results
/// are partial sums over the mesh axes their inputs are split on (see the module docs for the
/// layouts that box nothing).
pub fn sum_squares_multi(tensors: &[&Tensor]) -> Result<TensorSums> {
    multi_sum(SumTerm::Square, tensors)
}

/// As [`sum_squares_multi`] with `x * 0` for `x * x`: each sum is NaN exactly when its tensor
/// holds a NaN or an infinity, else 0.
pub fn non_finite_sums(tensors: &[&Tensor]) -> Result<TensorSums> {
    multi_sum(SumTerm::TimesZero, tensors)
}

fn multi_sum(term: SumTerm, tensors: &[&Tensor]) -> Result<TensorSums> {
    let _ng = no_grad();
    let op = SumSquares::for_inputs(term, tensors);
    let mut out = dispatch_multi(Extern::new(op).into(), tensors)?.into_iter();
    match (out.next(), out.next()) {
        (Some(each), Some(total)) => Ok(TensorSums { each, total }),
        _ => Err(TensorError::Kernel {
            op: "sum_squares",
            detail: "the op gave fewer than 2 outputs".into(),
        }),
    }
}
