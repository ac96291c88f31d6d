//! A tiny reference interpreter of the SBP algebra on plain f64 arrays: materialise each rank's
//! local pieces of a whole input under an nd-SBP (split / broadcast / partial components), run
//! an op on each rank's pieces, and reassemble the global value from the output nd-SBP.

#![allow(dead_code)]

pub mod arr;
pub mod op;
pub mod ops;

use oxiflow_placement::Placement;
use oxiflow_sbp::{BalancedSplitter, GlobalLayout, NdSbp, ReduceOp, Sbp, Shape, Signature};

use op::RuleCall;

pub use arr::{close, concat, Arr};

/// An nd-SBP of one SBP per entry of `pick` for an input of `ndim` dims: each entry chooses
/// S over an existing dim, B, P, P(max) or P(min).
pub fn nd_of(ndim: usize, pick: &[usize]) -> NdSbp {
    NdSbp::new(pick.iter().map(|&c| {
        let c = c % (ndim + 4);
        match c.checked_sub(ndim) {
            None => Sbp::S(c),
            Some(0) => Sbp::B,
            Some(1) => Sbp::P,
            Some(2) => Sbp::Partial(ReduceOp::Max),
            _ => Sbp::Partial(ReduceOp::Min),
        }
    }))
}

/// Local pieces of `whole` on every rank (row-major mesh order) under `nd`. Mesh axes apply in
/// order, axis 0 outermost: S(d) splits the current block's dim d with the balanced splitter,
/// B copies it, P(op) replaces it by p components that reduce with op to the block (element-
/// dependent pseudo-random components, not "one rank holds it").
pub fn materialise(whole: &Arr, mesh: &[usize], nd: &NdSbp, seed: u64) -> Vec<Arr> {
    let mut out = Vec::new();
    rec_materialise(whole.clone(), 0, mesh, nd, seed, &mut out);
    out
}

fn rec_materialise(v: Arr, axis: usize, mesh: &[usize], nd: &NdSbp, seed: u64, out: &mut Vec<Arr>) {
    if axis == mesh.len() {
        out.push(v);
        return;
    }
    let p = mesh[axis];
    let salt = seed.wrapping_mul(31).wrapping_add(axis as u64 + 1);
    let parts: Vec<Arr> = match nd[axis] {
        Sbp::Split(d) => {
            let sp = BalancedSplitter::new(v.shape[d], p);
            (0..p).map(|k| v.narrow(d, sp.range(k))).collect()
        }
        Sbp::Broadcast => vec![v; p],
        Sbp::Partial(ReduceOp::Sum) => {
            let mut rest = v.clone();
            let mut parts = Vec::with_capacity(p);
            for k in 0..p - 1 {
                let c = Arr::new(
                    v.shape.clone(),
                    (0..v.data.len())
                        .map(|e| 4.0 * arr::hash01(salt, e as u64, k as u64) - 2.0)
                        .collect(),
                );
                rest = rest.zip(&c, |a, b| a - b).unwrap_or_else(|e| panic!("{e}"));
                parts.push(c);
            }
            parts.push(rest);
            parts
        }
        Sbp::Partial(op) => {
            // Per element one rank holds the value, the others the value moved away from it.
            let sign = if op == ReduceOp::Max { -1.0 } else { 1.0 };
            (0..p)
                .map(|k| {
                    let data = v
                        .data
                        .iter()
                        .enumerate()
                        .map(|(e, &x)| {
                            let holder = (arr::hash01(salt, e as u64, 99) * p as f64) as usize % p;
                            if holder == k {
                                x
                            } else {
                                x + sign * (0.5 + arr::hash01(salt, e as u64, k as u64))
                            }
                        })
                        .collect();
                    Arr::new(v.shape.clone(), data)
                })
                .collect()
        }
    };
    for part in parts {
        rec_materialise(part, axis + 1, mesh, nd, seed, out);
    }
}

/// The global value from the local pieces (row-major mesh order): concatenation over S axes,
/// reduction over P axes; B axes must hold equal copies.
pub fn reassemble(locals: &[Arr], mesh: &[usize], nd: &NdSbp) -> Result<Arr, String> {
    rec_reassemble(locals, 0, mesh, nd)
}

fn rec_reassemble(locals: &[Arr], axis: usize, mesh: &[usize], nd: &NdSbp) -> Result<Arr, String> {
    if axis == mesh.len() {
        return Ok(locals[0].clone());
    }
    let p = mesh[axis];
    let chunk = locals.len() / p;
    let kids = (0..p)
        .map(|k| rec_reassemble(&locals[k * chunk..(k + 1) * chunk], axis + 1, mesh, nd))
        .collect::<Result<Vec<_>, _>>()?;
    match nd[axis] {
        Sbp::Split(d) => concat(&kids, d),
        Sbp::Broadcast => {
            if let Some(k) = kids.iter().position(|k| !close(k, &kids[0])) {
                return Err(format!(
                    "B copies differ on mesh axis {axis}: {:?} vs {:?}",
                    kids[0], kids[k]
                ));
            }
            Ok(kids[0].clone())
        }
        Sbp::Partial(op) => {
            let f: fn(f64, f64) -> f64 = match op {
                ReduceOp::Sum => |a, b| a + b,
                ReduceOp::Max => f64::max,
                ReduceOp::Min => f64::min,
            };
            kids[1..]
                .iter()
                .try_fold(kids[0].clone(), |acc, k| acc.zip(k, f))
        }
    }
}

/// Whether each input is integral (ids, labels): the op's input positions that hold indices.
pub fn integral_inputs(op: &RuleCall) -> Vec<usize> {
    match op {
        RuleCall::Embedding | RuleCall::EmbeddingBackward { .. } => vec![0],
        RuleCall::CrossEntropy | RuleCall::CrossEntropyBackward => vec![1],
        RuleCall::Gather { .. } | RuleCall::IndexSelect { .. } => vec![1],
        RuleCall::ScatterAdd { .. } | RuleCall::IndexAdd { .. } => vec![0],
        _ => vec![],
    }
}

/// Applies `sig` to whole `inputs` the distributed way and compares with the op on the whole
/// arrays: per rank, materialise the input pieces, run the op locally (its output shapes taken
/// from the output layouts), check the local shapes, reassemble every output.
pub fn check_signature(
    op: &RuleCall,
    inputs: &[Arr],
    placement: &Placement,
    sig: &Signature,
    seed: u64,
) -> Result<(), String> {
    let mesh = placement.shape();
    let global_in: Vec<Vec<usize>> = inputs.iter().map(|a| a.shape.clone()).collect();
    let global_out: Vec<Vec<usize>> = sig.output_shapes.iter().map(|s| s.to_vec()).collect();
    let whole = Starts {
        inputs: global_in.iter().map(|s| vec![0; s.len()]).collect(),
        outputs: global_out.iter().map(|s| vec![0; s.len()]).collect(),
    };
    let expect = ops::run(op, inputs, &global_out, &global_in, &whole)?;
    for i in integral_inputs(op) {
        if sig.inputs[i].has_partial() {
            return Err(format!("signature {sig} makes integer input {i} partial"));
        }
    }
    let pieces: Vec<Vec<Arr>> = inputs
        .iter()
        .zip(&sig.inputs)
        .enumerate()
        .map(|(i, (a, nd))| materialise(a, mesh, nd, seed.wrapping_add(i as u64 * 1000)))
        .collect();
    let out_layouts = sig
        .output_shapes
        .iter()
        .zip(&sig.outputs)
        .map(|(s, nd)| GlobalLayout::new(s.clone(), placement, nd.clone()))
        .collect::<Result<Vec<_>, _>>()
        .map_err(|e| e.to_string())?;
    let in_layouts = inputs
        .iter()
        .zip(&sig.inputs)
        .map(|(a, nd)| GlobalLayout::new(shape_of(a), placement, nd.clone()))
        .collect::<Result<Vec<_>, _>>()
        .map_err(|e| e.to_string())?;
    let n = placement.num_ranks();
    let mut local_outs: Vec<Vec<Arr>> = vec![Vec::with_capacity(n); sig.outputs.len()];
    for r in 0..n {
        let coord = placement.coord_of_index(r);
        let local_in: Vec<Arr> = pieces.iter().map(|p| p[r].clone()).collect();
        let shapes: Vec<Vec<usize>> = out_layouts
            .iter()
            .map(|l| l.local_shape_at(&coord).to_vec())
            .collect();
        let starts_of = |l: &GlobalLayout| -> Vec<usize> {
            l.region_at(&coord).iter().map(|r| r.start).collect()
        };
        let starts = Starts {
            inputs: in_layouts.iter().map(starts_of).collect(),
            outputs: out_layouts.iter().map(starts_of).collect(),
        };
        let outs = ops::run(op, &local_in, &shapes, &global_in, &starts)?;
        for (o, (a, s)) in outs.into_iter().zip(&shapes).enumerate() {
            if &a.shape != s {
                return Err(format!(
                    "rank {r}: local output {o} has shape {:?}, layout says {s:?}",
                    a.shape
                ));
            }
            local_outs[o].push(a);
        }
    }
    for (o, locals) in local_outs.iter().enumerate() {
        let got = reassemble(locals, mesh, &sig.outputs[o])?;
        if !close(&got, &expect[o]) {
            return Err(format!(
                "output {o} under {sig}: got {:?}, expected {:?}",
                got, expect[o]
            ));
        }
    }
    Ok(())
}

/// Where a rank's pieces start in the global arrays: per input and per output, the start of
/// its region on each dim (what an op's local attributes read, e.g. a vocabulary offset).
pub struct Starts {
    pub inputs: Vec<Vec<usize>>,
    pub outputs: Vec<Vec<usize>>,
}

/// Shape of an `Arr` as a `Shape`.
pub fn shape_of(a: &Arr) -> Shape {
    Shape::from(a.shape.clone())
}
