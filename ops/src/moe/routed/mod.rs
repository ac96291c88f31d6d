//! The routed SwiGLU experts of an expert-parallel mixture: token rows x `[m, c]`, each routed
//! to expert `ids[m]`, through that expert's SwiGLU MLP (`gate`, `up` `[experts, c, f]`,
//! `down` `[experts, f, c]`, the experts stacked on dim 0): `y[m] = (silu(x[m] gate[e]) *
//! (x[m] up[e])) down[e]`, one row out per row in, in row order. The routing weights are
//! applied outside (a product with the rows' weights), so their gradient flows through
//! ordinary ops.
//!
//! Layouts (`oxiflow_sbp::rules::routed_experts`): where a mesh axis splits both the rows
//! and the experts, the kernel exchanges rows over that axis's ranks (their
//! [`Peers`](oxiflow_tensor::Peers)): each rank orders its rows by the rank holding their
//! expert, the ranks exchange their row counts and then the rows and their ids (an
//! all-to-all-v whose receive counts are data), each runs its own experts on the rows it
//! received and sends the results back by the reverse all-to-all-v, and puts them in row
//! order. A rank may send or receive no rows, and an expert may get none. Rows split with
//! the experts whole run locally; each expert's hidden columns split give partial sums. The
//! backward ([`Pass::Backward`]) mirrors it: rows and their output gradients travel to the
//! experts' ranks, each computes its experts' weight gradients (whole: every row of its
//! experts reached it) and the rows' gradients, which travel back. Uneven expert counts per
//! rank follow the balanced splitter. Kernels: CPU in f32, f64 and bf16 (computed in f32,
//! rounded once); CUDA in f32, bf16 and f16, the exchange over NCCL (`cuda.rs`);
//! other backends and dtypes are `TensorError::NoKernel` on every rank before anything runs.
//! A compiled step replays the op launch by launch, and on CUDA outside any device graph (its
//! kernels read the routing back to the host).

mod cpu;
mod cuda;
mod cuda_exchange;
mod cuda_rows;

use std::sync::LazyLock;

use crate::operand_dtypes::cpu_and_cuda_scratch;
use oxiflow_dtype::DType;
use oxiflow_sbp::{rules, RuleMode, Shape};
use oxiflow_tensor::{
    dispatch, dispatch_multi, Extern, ExternOp, Grad, Inferred, Kernels, LocalAt, MetaError,
    MetaResult, Peers, Result, Saves, Tensor, TensorError,
};

/// Which pass of the op.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Pass {
    /// (x, ids, gate, up, down) -> y.
    Forward,
    /// (x, ids, gate, up, down, dy) -> (dx, dgate, dup, ddown).
    Backward,
}

/// The routed SwiGLU experts, one pass (see the module docs); on a rank, with the group it
/// exchanges rows with (the ranks splitting the experts), or why there is none.
#[derive(Clone, Debug)]
pub struct RoutedExperts {
    pub pass: Pass,
    peers: Option<std::result::Result<Peers, String>>,
}

impl RoutedExperts {
    /// The global op of `pass`.
    pub fn new(pass: Pass) -> RoutedExperts {
        RoutedExperts { pass, peers: None }
    }
}

const FLOATS_AND_IDS: &[DType] = &[DType::F32, DType::F64, DType::BF16, DType::I64];

/// cuBLASLt's float types beside the ids.
const CUDA_FLOATS_AND_IDS: &[DType] = &[DType::F32, DType::BF16, DType::F16, DType::I64];

static FORWARD: LazyLock<Kernels> = LazyLock::new(|| {
    cpu_and_cuda_scratch::<RoutedExperts>(
        (FLOATS_AND_IDS, cpu::forward),
        (CUDA_FLOATS_AND_IDS, cuda::forward, cuda::scratch::<false>),
    )
});
static BACKWARD: LazyLock<Kernels> = LazyLock::new(|| {
    cpu_and_cuda_scratch::<RoutedExperts>(
        (FLOATS_AND_IDS, cpu::backward),
        (CUDA_FLOATS_AND_IDS, cuda::backward, cuda::scratch::<true>),
    )
});

/// The experts' SwiGLU MLPs applied to the rows `x [m, c]` routed by `ids [m]` (i64, each in
/// `0..experts`): gate and up `[experts, c, f]`, down `[experts, f, c]` -> `[m, c]` (see the
/// module docs for the exchange over an expert-splitting mesh axis).
pub fn routed_experts(
    x: &Tensor,
    ids: &Tensor,
    gate: &Tensor,
    up: &Tensor,
    down: &Tensor,
) -> Result<Tensor> {
    dispatch(
        Extern::new(RoutedExperts::new(Pass::Forward)).into(),
        &[x, ids, gate, up, down],
    )
}

impl ExternOp for RoutedExperts {
    fn graph_refusal(&self) -> Option<String> {
        Some(super::READS_ROUTING.into())
    }

    fn name(&self) -> &'static str {
        match self.pass {
            Pass::Forward => "routed_experts",
            Pass::Backward => "routed_experts_backward",
        }
    }

    fn attrs(&self, key: &mut Vec<u8>) {
        key.push(u8::from(self.pass == Pass::Backward));
    }

    fn arity(&self) -> (usize, usize) {
        match self.pass {
            Pass::Forward => (5, 5),
            Pass::Backward => (6, 6),
        }
    }

    fn infer(&self, shapes: &[&Shape], dtypes: &[DType], mode: RuleMode) -> MetaResult<Inferred> {
        if dtypes.get(1) != Some(&DType::I64) {
            return Err(MetaError::DType(format!(
                "the expert ids (input 1) must be i64, got {:?}",
                dtypes.get(1)
            )));
        }
        let dt = dtypes[0];
        if !dt.is_float() || dtypes.iter().skip(2).any(|&d| d != dt) {
            return Err(MetaError::DType(format!(
                "the rows, the experts' matrices (and dy) must share one float dtype, got \
                 {dtypes:?}"
            )));
        }
        match self.pass {
            Pass::Forward => {
                let r = rules::routed_experts(shapes, mode).map_err(MetaError::Shape)?;
                Ok(Inferred::new(r, dt))
            }
            Pass::Backward => {
                let r = rules::routed_experts_backward(shapes, mode).map_err(MetaError::Shape)?;
                Ok(Inferred::outputs(r, &[dt; 4]))
            }
        }
    }

    fn local(&self, at: &LocalAt<'_>) -> Option<Extern> {
        // The ranks splitting the stacked experts (gate's dim 0); up and down must hold the
        // same experts.
        let peers = at.peers_along(2, 0).and_then(|p| {
            for i in [3, 4] {
                let other = at.peers_along(i, 0)?;
                if other.regions() != p.regions() {
                    return Err(format!(
                        "input {i} holds experts {:?}, gate {:?}",
                        other.regions(),
                        p.regions()
                    ));
                }
            }
            Ok(p)
        });
        Some(Extern::new(RoutedExperts {
            pass: self.pass,
            peers: Some(peers),
        }))
    }

    fn kernels(&self) -> &Kernels {
        match self.pass {
            Pass::Forward => &FORWARD,
            Pass::Backward => &BACKWARD,
        }
    }

    fn no_gradient(&self) -> Option<&'static str> {
        (self.pass == Pass::Backward)
            .then_some("it computes the routed experts' gradients (no double backward)")
    }

    fn saves(&self, _needs: &[bool]) -> Saves {
        match self.pass {
            // The backward recomputes the hidden activations from the rows and matrices.
            Pass::Forward => Saves::inputs(&[0, 1, 2, 3, 4]),
            Pass::Backward => Saves::NOTHING,
        }
    }

    fn backward(&self, g: &Grad<'_>) -> Result<Vec<Option<Tensor>>> {
        if self.pass == Pass::Backward {
            return Err(Grad::unsupported(
                self.name(),
                "it computes the routed experts' gradients (no double backward)",
            ));
        }
        let ins = (0..5).map(|i| g.input(i)).collect::<Result<Vec<_>>>()?;
        let dy = g.dy()?;
        let op = Extern::new(RoutedExperts::new(Pass::Backward));
        let mut grads =
            dispatch_multi(op.into(), &[ins[0], ins[1], ins[2], ins[3], ins[4], dy])?.into_iter();
        let mut next = |i: usize| -> Result<Option<Tensor>> {
            let t = grads.next().ok_or_else(|| TensorError::Kernel {
                op: "routed_experts_backward",
                detail: "the op gave fewer than 4 gradients".into(),
            })?;
            Ok(g.need(i).then_some(t))
        };
        let dx = next(0)?;
        Ok(vec![dx, None, next(2)?, next(3)?, next(4)?])
    }
}
