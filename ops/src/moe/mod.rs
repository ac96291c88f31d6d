//! The mixture-of-experts ops: the routed product of token rows with their experts' matrices
//! ([`expert_matmul`]: `y[m] = x[m] @ w[ids[m]]`, or with each matrix transposed), its weight
//! gradient ([`expert_matmul_wgrad`]: each expert's `sum a[m]^T b[m]` over its rows), and the
//! router's top-k selection ([`router_topk`]: each row's k largest probabilities' experts and
//! the number of rows each expert got). Tokens routed to k experts are k rows each; the
//! kernels group the rows of one expert (a gather), multiply them with its matrix once and put
//! the results back in row order (the scatter), so the layout of rows never depends on the
//! routing and splitting rows over ranks splits the work.
//!
//! Layouts (`oxiflow_sbp::rules::{expert_matmul, expert_matmul_wgrad, router_topk}`): rows
//! split, matrices split like a matmul's right operand, partial sums through the linear
//! operands. Gradients: the product's flow to its rows (the transposed product) and to the
//! matrices (the weight gradient); the expert ids and the top-k selection have none (the
//! routing weights, gathered from the probabilities by the ids, carry it). Kernels: CPU in
//! f32, f64 and bf16 (computed in f32, rounded once); CUDA in f32, bf16 and f16 (cuBLASLt
//! products with f32 accumulation, the ids read back once per call: see `cuda.rs`); the
//! top-k in f32 and f64 on both. Any other backend or dtype is `TensorError::NoKernel` on
//! every rank before anything runs.
//!
//! [`routed::routed_experts`] runs whole SwiGLU experts stacked on one tensor, exchanging the
//! rows with the ranks that hold their experts where a mesh axis splits both (expert
//! parallelism).

mod cpu;
mod cuda;
pub mod routed;

use std::sync::LazyLock;

use crate::op_signature::{kernels_without_gradient, op_signature};
use crate::operand_dtypes::{cpu_and_cuda_scratch, kernels_for};
use oxiflow_dtype::DType;
use oxiflow_sbp::{rules, RuleMode, Shape};
use oxiflow_tensor::{
    dispatch, dispatch_multi, Extern, ExternOp, Grad, Inferred, Kernels, MetaError, MetaResult,
    Result, Saves, Tensor, TensorError,
};

/// `y[m] = x[m] @ w[ids[m]]` (`transposed`: `x[m] @ w[ids[m]]^T`) over `experts` matrices
/// (inputs: x, ids, then the matrices).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct ExpertMatmul {
    pub experts: usize,
    pub transposed: bool,
}

/// `g[e] = sum over rows m with ids[m] = e of a[m]^T b[m]` (inputs: a, ids, b; `experts`
/// outputs).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct ExpertMatmulWgrad {
    pub experts: usize,
}

/// Each row's `k` largest probabilities' experts (largest first, the lower expert first among
/// equals) and the count of rows routed to each expert (input: probabilities `[m, experts]`;
/// outputs: ids `[m, k]` i64, counts `[experts]` in the probabilities' dtype).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct RouterTopk {
    pub k: usize,
}

/// `x [m, k]` rows times their experts' matrices `ws` (each `[k, n]`) picked by `ids [m]`
/// (i64) -> `[m, n]`; `transposed`: `x [m, n]` times each matrix transposed -> `[m, k]`.
pub fn expert_matmul(x: &Tensor, ids: &Tensor, ws: &[Tensor], transposed: bool) -> Result<Tensor> {
    let op = ExpertMatmul {
        experts: ws.len(),
        transposed,
    };
    let mut inputs = vec![x, ids];
    inputs.extend(ws);
    dispatch(Extern::new(op).into(), &inputs)
}

/// Each of `experts` experts' `sum a[m]^T b[m]` over the rows `ids` routes to it (a `[m, k]`,
/// b `[m, n]`) -> `experts` matrices `[k, n]` (zeros for an expert no row reaches).
pub fn expert_matmul_wgrad(
    a: &Tensor,
    ids: &Tensor,
    b: &Tensor,
    experts: usize,
) -> Result<Vec<Tensor>> {
    let g = dispatch_multi(
        Extern::new(ExpertMatmulWgrad { experts }).into(),
        &[a, ids, b],
    )?;
    if g.len() != experts {
        return Err(TensorError::Kernel {
            op: "expert_matmul_wgrad",
            detail: format!("the op gave {} outputs for {experts} experts", g.len()),
        });
    }
    Ok(g)
}

/// The `k` experts of largest probability of each row of `probs [m, experts]`: ids `[m, k]`
/// (i64) and the rows routed to each expert `[experts]` (in `probs`' dtype; a partial sum
/// when the rows are split over ranks).
pub fn router_topk(probs: &Tensor, k: usize) -> Result<(Tensor, Tensor)> {
    let mut out = dispatch_multi(Extern::new(RouterTopk { k }).into(), &[probs])?.into_iter();
    match (out.next(), out.next()) {
        (Some(ids), Some(counts)) => Ok((ids, counts)),
        _ => Err(TensorError::Kernel {
            op: "router_topk",
            detail: "the op gave fewer than 2 outputs".into(),
        }),
    }
}

const FLOATS_AND_IDS: &[DType] = &[DType::F32, DType::F64, DType::BF16, DType::I64];
/// cuBLASLt's float types beside the ids (f64 products have no CUDA kernel).
const CUDA_FLOATS_AND_IDS: &[DType] = &[DType::F32, DType::BF16, DType::F16, DType::I64];
const PROBABILITIES: &[DType] = &[DType::F32, DType::F64];

static MATMUL: LazyLock<Kernels> = LazyLock::new(|| {
    cpu_and_cuda_scratch::<ExpertMatmul>(
        (FLOATS_AND_IDS, cpu::expert_matmul),
        (
            CUDA_FLOATS_AND_IDS,
            cuda::expert_matmul,
            cuda::matmul_scratch,
        ),
    )
});

static WGRAD: LazyLock<Kernels> = LazyLock::new(|| {
    cpu_and_cuda_scratch::<ExpertMatmulWgrad>(
        (FLOATS_AND_IDS, cpu::expert_matmul_wgrad),
        (
            CUDA_FLOATS_AND_IDS,
            cuda::expert_matmul_wgrad,
            cuda::wgrad_scratch,
        ),
    )
});

static TOPK: LazyLock<Kernels> =
    LazyLock::new(|| kernels_for::<RouterTopk>(PROBABILITIES, cpu::router_topk, cuda::router_topk));

/// The float dtype of the operands `floats` (all alike) beside i64 expert ids `ids`.
fn routed_dtypes(dtypes: &[DType], ids: usize) -> MetaResult<DType> {
    if dtypes.get(ids) != Some(&DType::I64) {
        return Err(MetaError::DType(format!(
            "the expert ids (input {ids}) must be i64, got {:?}",
            dtypes.get(ids)
        )));
    }
    let floats: Vec<DType> = (0..dtypes.len())
        .filter(|&i| i != ids)
        .map(|i| dtypes[i])
        .collect();
    let d = floats[0];
    if floats.iter().any(|&x| x != d) || !d.is_float() {
        return Err(MetaError::DType(format!(
            "the rows and matrices must share one float dtype, got {floats:?}"
        )));
    }
    Ok(d)
}

/// Why a device graph cannot hold the routed products: their CUDA kernels read each call's
/// expert ids back to the host to size each expert's product.
pub(crate) const READS_ROUTING: &str =
    "its CUDA kernels read each call's expert ids back to the host to size the experts' products";

impl ExternOp for ExpertMatmul {
    fn graph_refusal(&self) -> Option<String> {
        Some(READS_ROUTING.into())
    }

    fn name(&self) -> &'static str {
        "expert_matmul"
    }
    fn attrs(&self, key: &mut Vec<u8>) {
        key.extend_from_slice(&(self.experts as u64).to_le_bytes());
        key.push(u8::from(self.transposed));
    }
    fn arity(&self) -> (usize, usize) {
        (2 + self.experts, 2 + self.experts)
    }
    fn infer(&self, shapes: &[&Shape], dtypes: &[DType], mode: RuleMode) -> MetaResult<Inferred> {
        let dt = routed_dtypes(dtypes, 1)?;
        let r = rules::expert_matmul(shapes[0], shapes[1], &shapes[2..], self.transposed, mode)
            .map_err(MetaError::Shape)?;
        Ok(Inferred::new(r, dt))
    }
    fn kernels(&self) -> &Kernels {
        &MATMUL
    }
    fn saves(&self, needs: &[bool]) -> Saves {
        // The rows' gradient reads every matrix (a mask of all inputs: there may be more
        // experts than a mask of indices holds); the matrices' gradients read the rows.
        if needs.first().copied().unwrap_or(false) {
            return Saves::ALL_INPUTS;
        }
        Saves::inputs(&[1]).and_input_if(0, needs.iter().skip(2).any(|&n| n))
    }
    fn backward(&self, g: &Grad<'_>) -> Result<Vec<Option<Tensor>>> {
        let (ids, dy) = (g.input(1)?, g.dy()?);
        let mut out = Vec::with_capacity(2 + self.experts);
        out.push(g.when(0, || {
            let ws = (2..2 + self.experts)
                .map(|i| g.input(i).cloned())
                .collect::<Result<Vec<_>>>()?;
            expert_matmul(dy, ids, &ws, !self.transposed)
        })?);
        out.push(None);
        if (2..2 + self.experts).any(|i| g.need(i)) {
            let x = g.input(0)?;
            let dw = if self.transposed {
                expert_matmul_wgrad(dy, ids, x, self.experts)?
            } else {
                expert_matmul_wgrad(x, ids, dy, self.experts)?
            };
            out.extend(
                dw.into_iter()
                    .enumerate()
                    .map(|(e, w)| g.need(2 + e).then_some(w)),
            );
        } else {
            out.extend(std::iter::repeat_n(None, self.experts));
        }
        Ok(out)
    }
}

impl ExternOp for ExpertMatmulWgrad {
    fn graph_refusal(&self) -> Option<String> {
        Some(READS_ROUTING.into())
    }

    op_signature!("expert_matmul_wgrad", 3);
    fn attrs(&self, key: &mut Vec<u8>) {
        key.extend_from_slice(&(self.experts as u64).to_le_bytes());
    }
    fn infer(&self, shapes: &[&Shape], dtypes: &[DType], mode: RuleMode) -> MetaResult<Inferred> {
        let dt = routed_dtypes(dtypes, 1)?;
        let r = rules::expert_matmul_wgrad(shapes[0], shapes[1], shapes[2], self.experts, mode)
            .map_err(MetaError::Shape)?;
        Ok(Inferred::outputs(r, &vec![dt; self.experts]))
    }
    kernels_without_gradient!(WGRAD, "the experts' weight gradients have no gradient here");
}

impl ExternOp for RouterTopk {
    op_signature!("router_topk", 1);
    fn attrs(&self, key: &mut Vec<u8>) {
        key.extend_from_slice(&(self.k as u64).to_le_bytes());
    }
    fn infer(&self, shapes: &[&Shape], dtypes: &[DType], mode: RuleMode) -> MetaResult<Inferred> {
        let d = dtypes[0];
        if !matches!(d, DType::F32 | DType::F64) {
            return Err(MetaError::DType(format!(
                "router probabilities must be f32 or f64, got {d}"
            )));
        }
        let r = rules::router_topk(shapes[0], self.k, mode).map_err(MetaError::Shape)?;
        Ok(Inferred::outputs(r, &[DType::I64, d]))
    }
    kernels_without_gradient!(
        TOPK,
        "a selection has no gradient (the probabilities gathered by its ids carry it)"
    );
}
