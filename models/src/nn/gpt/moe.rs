//! The mixture-of-experts MLP of a block (Mixtral, Qwen2-MoE): a router (a linear map to one
//! logit per expert, softmax, the top k, optionally renormalised), SwiGLU experts each token
//! visits through its k routes (dropless: every route computes), and an optional shared expert
//! every token visits, scaled by a sigmoid gate. The routed experts' matrices are stacked on
//! one tensor each (`experts.gate`, `experts.up` `[E, C, F]`, `experts.down` `[E, F, C]`),
//! run by `oxiflow_ops::moe::routed::routed_experts`: each expert's hidden columns split over
//! the tensor-parallel axis like the dense MLP's, the experts themselves over an axis that
//! splits experts, where the token rows travel to their experts' ranks and back; tokens
//! otherwise stay on their data-parallel rank. Each block's routing statistics (`RouterStats`)
//! feed the Switch load-balancing loss over all blocks (`RouterLog::aux_loss`), as
//! transformers' `load_balancing_loss_func` computes it.

use oxiflow_dtype::DType;
use oxiflow_ops::moe::routed::routed_experts;
use oxiflow_ops::moe::router_topk;
use oxiflow_placement::{AxisRole, Placement};
use oxiflow_sbp::{NdSbp, Sbp, Shape};
use oxiflow_tensor::Tensor;

use crate::shape_error::shape_err;
use crate::{Result, TensorError};

use super::super::init::{param_seed, Init, ParamPlacement};
use super::super::linear::{Linear, Parallel};
use super::super::param::{Module, Parameter};
use super::arch::{Arch, MlpKind, MoeArch};
use super::config::{GptConfig, GptLayout};
use super::mlp::GptMlp;

/// One block's routing: the rows routed to each expert `[experts]` (no gradient) and the sum
/// of each expert's router probability over the tokens `[experts]`, over `rows` tokens.
#[derive(Clone, Debug)]
pub struct RouterStats {
    pub counts: Tensor,
    pub probs: Tensor,
    pub rows: usize,
}

/// The routing statistics of the blocks a forward pass ran (summed), and what the
/// load-balancing loss reads.
#[derive(Clone, Debug, Default)]
pub struct RouterLog {
    sum: Option<RouterStats>,
    experts: usize,
}

impl RouterLog {
    /// Adds one block's statistics (moved onto the first block's placement when a pipeline
    /// stage of its own computed them).
    pub fn add(&mut self, s: RouterStats) -> Result<()> {
        self.experts = s.counts.shape().numel();
        self.sum = Some(match self.sum.take() {
            None => s,
            Some(t) => RouterStats {
                counts: t.counts.add(&alike(&s.counts, &t.counts)?)?,
                probs: t.probs.add(&alike(&s.probs, &t.probs)?)?,
                rows: t.rows + s.rows,
            },
        });
        Ok(())
    }

    /// Adds every block's statistics of `other`.
    pub fn extend(&mut self, other: RouterLog) -> Result<()> {
        match other.sum {
            Some(s) => self.add(s),
            None => Ok(()),
        }
    }

    /// The Switch load-balancing loss over every block and token logged (a 0-d tensor, None
    /// when no mixture ran): `experts * sum_e (routes_e / rows) (probability_e / rows)`, each
    /// sum over blocks and tokens (transformers' `load_balancing_loss_func`).
    pub fn aux_loss(&self) -> Result<Option<Tensor>> {
        let Some(s) = &self.sum else {
            return Ok(None);
        };
        let scale = self.experts as f64 / (s.rows.max(1) as f64).powi(2);
        Ok(Some(s.counts.mul(&s.probs)?.sum_all()?.mul_scalar(scale)?))
    }
}

/// The routing statistics a pipeline stage passes on: what every block before it and its own
/// blocks routed, as one f64 vector `[counts | probabilities | rows]` (`2 experts + 1`
/// values, broadcast on the stage's placement, no gradient). The load-balancing loss is a
/// product of sums over all blocks, so a stage's share of its gradient needs the totals of
/// the whole pipeline: they travel forward with the stream and back with its gradient.
impl RouterLog {
    /// This log's sums plus `earlier` (the pack received from the stage before, on
    /// `placement`), packed on `placement` for routers of `experts` experts.
    pub fn pack(
        &self,
        earlier: Option<&Tensor>,
        experts: usize,
        placement: &Placement,
    ) -> Result<Tensor> {
        let nd = NdSbp::broadcast(placement.ndim());
        let own = match &self.sum {
            Some(s) if self.experts == experts => {
                let b = |t: &Tensor| {
                    t.detach()
                        .cast(DType::F64)?
                        .to_global(placement, nd.clone())
                };
                let rows =
                    Tensor::full_global([1], s.rows as f64, DType::F64, placement, nd.clone())?;
                Tensor::concat(&[&b(&s.counts)?, &b(&s.probs)?, &rows], 0)?
            }
            Some(_) => {
                return Err(TensorError::Shape {
                    op: "RouterLog::pack",
                    shapes: format!("{} experts", self.experts),
                    sbps: "-".into(),
                    detail: format!("the pipeline's routers have {experts} experts"),
                })
            }
            None => Tensor::zeros_global([2 * experts + 1], DType::F64, placement, nd)?,
        };
        match earlier {
            Some(e) => own.add(e),
            None => Ok(own),
        }
    }

    /// The share of the load-balancing loss of the blocks logged here, given the pipeline's
    /// `totals` (the pack after its last block): `experts * sum_e (C_e / R)(p_e / R)` with
    /// C and R every block's routes and rows and p these blocks' probabilities. Its gradient
    /// is the whole loss's gradient through these blocks (C carries none). None when
    /// nothing was logged.
    pub fn aux_share(&self, totals: &Tensor) -> Result<Option<Tensor>> {
        match &self.sum {
            Some(s) => Ok(Some(scaled_routes(totals, self.experts, &s.probs)?)),
            None => Ok(None),
        }
    }

    /// The whole load-balancing loss on the pipeline's last stage, whose gradient flows
    /// through the blocks logged here (the earlier stages' probabilities in `earlier` enter as
    /// values; each stage adds its own share's gradient with [`RouterLog::aux_share`]).
    pub fn aux_loss_after(
        &self,
        earlier: Option<&Tensor>,
        totals: &Tensor,
        experts: usize,
    ) -> Result<Option<Tensor>> {
        let before = earlier
            .map(|e| scaled_routes(totals, experts, &e.narrow(0, experts, experts)?))
            .transpose()?;
        match (before, self.aux_share(totals)?) {
            (Some(b), Some(own)) => Ok(Some(own.add(&b.cast(own.dtype())?)?)),
            (b, own) => Ok(own.or(b)),
        }
    }
}

/// `experts * sum_e C_e p_e / R^2` for the routes C and rows R (at least 1) of the pack
/// `totals` and probability sums `probs` `[experts]`, in `probs`' dtype; tensor ops only (no
/// host read, so a compiled step replays it).
fn scaled_routes(totals: &Tensor, experts: usize, probs: &Tensor) -> Result<Tensor> {
    let rows = totals.narrow(0, 2 * experts, 1)?;
    let one = rows.mul_scalar(0.0)?.add_scalar(1.0)?;
    let scale = Tensor::concat(&[&rows, &one], 0)?
        .max(&[0], false)?
        .pow_scalar(-2.0)?
        .mul_scalar(experts as f64)?
        .cast(probs.dtype())?;
    let counts = totals.narrow(0, 0, experts)?.cast(probs.dtype())?;
    counts.mul(probs)?.sum_all()?.mul(&scale)
}

/// `t` on the placement and nd-SBP of `like` (itself when `like` is local or `t` is on its
/// placement already).
fn alike(t: &Tensor, like: &Tensor) -> Result<Tensor> {
    match (like.placement(), like.nd_sbp()) {
        (Some(p), Some(nd)) if t.placement() != Some(p) => t.to_global(p, nd.clone()),
        _ => Ok(t.clone()),
    }
}

/// A block's mixture of experts: `name.router` `[C, E]`, the routed experts' stacked
/// matrices `name.experts.{gate,up,down}`, and optionally `name.shared` (SwiGLU) with
/// `name.shared_gate` `[C, 1]`.
#[derive(Clone, Debug)]
pub struct MoeMlp {
    pub router: Linear,
    /// `[E, C, F]`.
    pub gate: Parameter,
    /// `[E, C, F]`.
    pub up: Parameter,
    /// `[E, F, C]`.
    pub down: Parameter,
    pub shared: Option<(GptMlp, Linear)>,
    pub moe: MoeArch,
}

impl MoeMlp {
    pub fn new(
        name: &str,
        cfg: &GptConfig,
        arch: &Arch,
        moe: &MoeArch,
        layout: &GptLayout,
    ) -> Result<MoeMlp> {
        let c = cfg.width;
        let replicated = layout.linear_biased(cfg, Parallel::Replicated, false);
        let swiglu = |at: String, width: usize| {
            let a = Arch {
                mlp: MlpKind::SwiGlu,
                ffn_width: Some(width),
                mlp_bias: false,
                ..arch.clone()
            };
            GptMlp::new(&at, cfg, &a, layout)
        };
        let (e, f) = (moe.experts, moe.expert_width);
        // Each expert's matrix drawn as its dense layer's (uniform, bound 1/sqrt(inputs)).
        let stacked = |what: &str, shape: [usize; 3], hidden_dim: usize| -> Result<Parameter> {
            let name = format!("{name}.experts.{what}.weight");
            let init = Init::Uniform {
                seed: param_seed(cfg.seed, &name),
                bound: 1.0 / (shape[1].max(1) as f64).sqrt(),
            };
            let at = expert_placement(layout, hidden_dim);
            Ok(Parameter::new(
                name,
                &init.build(Shape::new(shape), cfg.dtype, &at)?,
            ))
        };
        let shared = match moe.shared_width {
            Some(s) => Some((
                swiglu(format!("{name}.shared"), s)?,
                Linear::new(&format!("{name}.shared_gate"), c, 1, &replicated)?,
            )),
            None => None,
        };
        Ok(MoeMlp {
            router: Linear::new(&format!("{name}.router"), c, moe.experts, &replicated)?,
            gate: stacked("gate", [e, c, f], 2)?,
            up: stacked("up", [e, c, f], 2)?,
            down: stacked("down", [e, f, c], 1)?,
            shared,
            moe: moe.clone(),
        })
    }

    /// h `[B, T, C]` (whole on the tensor-parallel axis) -> the mixture's output `[B, T, C]`
    /// (a partial sum on that axis when the experts are split over it) and the block's
    /// routing statistics.
    pub fn forward(&self, h: &Tensor) -> Result<(Tensor, RouterStats)> {
        let dims = h.shape().dims().to_vec();
        let [b, t, c] = dims[..] else {
            return Err(shape_err(
                "MoeMlp::forward",
                h,
                "the input must be [B, T, C]".into(),
            ));
        };
        let (n, k) = (b * t, self.moe.top_k);
        let x = h.reshape([n, c])?;
        // The router in f32 at least (as transformers computes its softmax).
        let logits = self.router.forward(&x)?;
        let logits = match logits.dtype() {
            DType::F64 | DType::F32 => logits,
            _ => logits.cast(DType::F32)?,
        };
        let probs = logits.softmax(-1)?;
        let (ids, counts) = router_topk(&probs.detach(), k)?;
        let mut weights = probs.gather(1, &ids)?;
        if self.moe.renormalize {
            weights = weights.div(&weights.sum(&[-1], true)?)?;
        }
        let weights = weights.cast(x.dtype())?.reshape([n, k, 1])?;
        // Each token once per route, routes in row order.
        let x3 = x.reshape([n, 1, c])?;
        let rows = Tensor::concat(&vec![&x3; k], 1)?.reshape([n * k, c])?;
        let routes = ids.reshape([n * k])?;
        let out = routed_experts(
            &rows,
            &routes,
            &self.gate.compute()?,
            &self.up.compute()?,
            &self.down.compute()?,
        )?;
        let mut y = out.reshape([n, k, c])?.mul(&weights)?.sum(&[1], false)?;
        if let Some((mlp, gate)) = &self.shared {
            let s = mlp.proj.forward(&mlp.hidden(&x)?)?;
            y = y.add(&s.mul(&gate.forward(&x)?.sigmoid()?)?)?;
        }
        let stats = RouterStats {
            counts,
            probs: probs.sum(&[0], false)?,
            rows: n,
        };
        Ok((y.reshape([b, t, c])?, stats))
    }
}

/// Where a stacked expert matrix lives: the experts (dim 0) split over the mesh axis that
/// splits experts, each expert's hidden units (dim `hidden_dim`) over the tensor-parallel
/// axis, whole on every other axis.
fn expert_placement(layout: &GptLayout, hidden_dim: usize) -> ParamPlacement {
    match layout.mesh() {
        None => ParamPlacement::Local,
        Some(m) => ParamPlacement::Global {
            placement: m.placement().clone(),
            nd_sbp: NdSbp::new(m.axes().iter().map(|a| {
                if a.kind.splits(AxisRole::Experts) {
                    Sbp::S(0)
                } else if a.kind.splits(AxisRole::Heads) {
                    Sbp::S(hidden_dim)
                } else {
                    Sbp::B
                }
            })),
        },
    }
}

impl Module for MoeMlp {
    fn parameters(&self) -> Vec<Parameter> {
        let mut v = self.router.parameters();
        v.extend([self.gate.clone(), self.up.clone(), self.down.clone()]);
        if let Some((mlp, gate)) = &self.shared {
            v.extend(mlp.parameters());
            v.extend(gate.parameters());
        }
        v
    }
}
