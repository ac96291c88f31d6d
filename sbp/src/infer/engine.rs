//! `InferEngine`: picks, among an op call's n-d candidates (built by its rule builder), the one
//! whose input boxing costs the fewest bytes, and lists the candidates. Stateless: callers
//! cache their choices (the tensor crate's dispatch plans).

use std::fmt;

use oxiflow_placement::Placement;
use smallvec::SmallVec;

use super::candidates::for_each_nd;
use super::Rules;
use crate::cost::inference_cost_parts;
use crate::{check_nd_sbp, NdSbp, SbpError, Shape};

/// The chosen nd-SBP of every input and output of one op call, the output shapes, and its cost:
/// the sum over inputs of `inference_cost` (per-rank bytes of boxing the input to it, as
/// `transition_cost` estimates, plus the deferred reduction of any S -> P).
#[derive(Clone, Debug, PartialEq, Eq, Hash)]
pub struct Signature {
    pub inputs: Vec<NdSbp>,
    pub outputs: Vec<NdSbp>,
    pub output_shapes: Vec<Shape>,
    pub cost: u64,
}

impl fmt::Display for Signature {
    /// `(S(0), B), B -> (S(0), B)`.
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write_list(f, &self.inputs)?;
        f.write_str(" -> ")?;
        write_list(f, &self.outputs)
    }
}

fn write_list(f: &mut fmt::Formatter<'_>, xs: &[NdSbp]) -> fmt::Result {
    for (i, x) in xs.iter().enumerate() {
        if i > 0 {
            f.write_str(", ")?;
        }
        write!(f, "{x}")?;
    }
    Ok(())
}

/// Signature inference over the candidates of a rule builder (`rules`).
///
/// All inputs must share one placement: the tensor layer boxes inputs on different placements
/// to a common one before it chooses.
pub struct InferEngine;

impl InferEngine {
    /// The signature among `rules`' candidates (built in `RuleMode::Candidates` by the op's
    /// rule builder for these input shapes; all-B is added when missing) whose input boxing
    /// costs the fewest bytes (`inference_cost`, elements of `elem_size` bytes), ties broken by
    /// fewer boxed (input, mesh axis) pairs, then by candidate order; so inputs that already
    /// fit a candidate are never touched, and every rank picks the same signature. `op` names
    /// the op in errors.
    pub fn choose(
        op: &str,
        mut rules: Rules,
        inputs: &[(&Shape, &NdSbp)],
        placement: &Placement,
        elem_size: usize,
    ) -> Result<Signature, SbpError> {
        check_inputs(op, inputs, placement)?;
        rules.push_all_broadcast(inputs.len());
        let mesh = placement.shape();
        let mut best: Option<(u64, usize, Vec<NdSbp>, Vec<NdSbp>)> = None;
        for_each_nd(&rules, placement, |ins, outs| {
            let mut cost = 0u64;
            let mut steps = 0usize;
            for ((shape, from), to) in inputs.iter().zip(ins) {
                cost = cost.saturating_add(inference_cost_parts(shape, mesh, from, to, elem_size));
                steps += from.iter().zip(to.iter()).filter(|(a, b)| a != b).count();
                if best.as_ref().is_some_and(|b| cost > b.0) {
                    return;
                }
            }
            if best.as_ref().is_none_or(|b| (cost, steps) < (b.0, b.1)) {
                best = Some((cost, steps, ins.to_vec(), outs.to_vec()));
            }
        });
        let (cost, _, inputs_nd, outputs) = best.ok_or_else(|| {
            let shapes: SmallVec<[&Shape; 3]> = inputs.iter().map(|(s, _)| *s).collect();
            SbpError::Op {
                op: op.to_string(),
                detail: "no candidate signature".into(),
                shapes: shape_list(&shapes),
                sbps: inputs
                    .iter()
                    .map(|(_, n)| n.to_string())
                    .collect::<Vec<_>>()
                    .join(", "),
                placement: placement.to_string(),
            }
        })?;
        Ok(Signature {
            inputs: inputs_nd,
            outputs,
            output_shapes: rules.out_shapes().to_vec(),
            cost,
        })
    }

    /// Every n-d candidate of `rules` (all-B added when missing) over `placement`, in the
    /// order `choose` considers them (cost 0: no current layout is given).
    pub fn candidates(mut rules: Rules, n_inputs: usize, placement: &Placement) -> Vec<Signature> {
        rules.push_all_broadcast(n_inputs);
        let mut out = Vec::new();
        for_each_nd(&rules, placement, |ins, outs| {
            out.push(Signature {
                inputs: ins.to_vec(),
                outputs: outs.to_vec(),
                output_shapes: rules.out_shapes().to_vec(),
                cost: 0,
            })
        });
        out
    }
}

/// Each input's nd-SBP fits its shape and the placement.
fn check_inputs(
    op: &str,
    inputs: &[(&Shape, &NdSbp)],
    placement: &Placement,
) -> Result<(), SbpError> {
    for (index, (shape, nd)) in inputs.iter().enumerate() {
        check_nd_sbp(shape, placement, nd).map_err(|e| SbpError::Input {
            op: op.to_string(),
            index,
            source: Box::new(e),
        })?;
    }
    Ok(())
}

fn shape_list(shapes: &[&Shape]) -> String {
    let v: Vec<String> = shapes.iter().map(|s| s.to_string()).collect();
    v.join(", ")
}
