//! Candidate tables of element-wise ops and numpy broadcasting: unary, binary, broadcast-to and
//! its gradient reduce-to-shape.

use super::{RuleMode, Rules, PARTIALS};
use crate::{ReduceOp, Sbp, Shape};

/// Element-wise binary ops (numpy broadcasting).
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub enum BinaryOp {
    Add,
    Sub,
    Mul,
    Div,
}

const B: Sbp = Sbp::Broadcast;
const P: Sbp = Sbp::P;
const PMAX: Sbp = Sbp::Partial(ReduceOp::Max);
const PMIN: Sbp = Sbp::Partial(ReduceOp::Min);

/// S(i)->S(i), B->B; P->P only when linear.
pub fn unary(x: &Shape, linear: bool, mode: RuleMode) -> Rules {
    let mut r = Rules::new(mode, [x.clone()]);
    if mode == RuleMode::ShapesOnly {
        return r;
    }
    for i in 0..x.ndim() {
        r.push(&[Sbp::S(i)], &[Sbp::S(i)]);
    }
    r.push(&[B], &[B]);
    if linear {
        r.push(&[P], &[P]);
    }
    r
}

/// SwiGLU of a packed input x `[.., F, 2]` (each gate value beside its up value) -> `[.., F]`:
/// any dim but the pairs' split alike, or whole. Never P (not linear in the gate).
pub fn swiglu_pairs(x: &Shape, mode: RuleMode) -> Result<Rules, String> {
    let nd = x.ndim();
    if nd < 2 || x.dim(nd - 1) != 2 {
        return Err(format!("x must be [.., F, 2] (gate and up pairs), got {x}"));
    }
    let mut r = Rules::new(mode, [Shape::new(x.dims()[..nd - 1].to_vec())]);
    for i in 0..nd - 1 {
        r.push(&[Sbp::S(i)], &[Sbp::S(i)]);
    }
    r.push(&[B], &[B]);
    Ok(r)
}

/// A pointwise op on same-shape inputs with `n_out` outputs of that shape: S(i) on every input
/// -> S(i) on every output; B -> B; and for each input in `linear` (every output is linear in
/// it, e.g. `up` of `silu(gate) * up`): P on it and B on the others -> P on every output.
pub fn pointwise(
    xs: &[&Shape],
    n_out: usize,
    linear: &[usize],
    mode: RuleMode,
) -> Result<Rules, String> {
    let Some(&first) = xs.first() else {
        return Err("no inputs".into());
    };
    if let Some(other) = xs.iter().find(|s| **s != first) {
        return Err(format!(
            "operands have different shapes {first} and {other}"
        ));
    }
    if let Some(&k) = linear.iter().find(|&&k| k >= xs.len()) {
        return Err(format!("input {k} of {} is not an operand", xs.len()));
    }
    let mut r = Rules::new(mode, std::iter::repeat_n(first.clone(), n_out));
    if mode == RuleMode::ShapesOnly {
        return Ok(r);
    }
    let outs = |s: Sbp| std::iter::repeat_n(s, n_out).collect::<Vec<_>>();
    for i in 0..first.ndim() {
        r.push(&vec![Sbp::S(i); xs.len()], &outs(Sbp::S(i)));
    }
    r.push_uniform(xs.len(), n_out, B);
    for &k in linear {
        let ins: Vec<Sbp> = (0..xs.len()).map(|j| if j == k { P } else { B }).collect();
        r.push(&ins, &outs(P));
    }
    Ok(r)
}

/// The numpy broadcast of two shapes.
pub fn broadcast_shape(a: &Shape, b: &Shape) -> Option<Shape> {
    if a == b {
        return Some(a.clone());
    }
    let n = a.ndim().max(b.ndim());
    let mut fits = true;
    let out = Shape::new((0..n).map(|o| {
        let x = dim_or_one(a, o, n);
        let y = dim_or_one(b, o, n);
        match (x, y) {
            _ if x == y => x,
            (1, _) => y,
            (_, 1) => x,
            _ => {
                fits = false;
                0
            }
        }
    }));
    fits.then_some(out)
}

/// Size of the input dim that lines up with output dim `o` of an `n`-dim output (1 if missing).
fn dim_or_one(x: &Shape, o: usize, n: usize) -> usize {
    let off = n - x.ndim();
    if o < off {
        1
    } else {
        x.dim(o - off)
    }
}

/// The SBP an operand takes when output dim `o` is split: its own matching dim when it has the
/// output's size there, otherwise (size 1 or missing) B.
pub(crate) fn split_through(x: &Shape, out: &Shape, o: usize) -> Sbp {
    let off = out.ndim() - x.ndim();
    if o >= off && x.dim(o - off) == out.dim(o) {
        Sbp::S(o - off)
    } else {
        B
    }
}

/// Broadcasting binary op: S(o) of the output maps to each operand's matching dim (size-1 or
/// missing dims take B); B,B->B; add/sub P,P->P; mul P,B and B,P -> P; div P,B -> P; adding a B
/// keeps P(max)/P(min), and subtracting a P(max) from a B gives P(min) (and the reverse).
pub fn binary(op: BinaryOp, a: &Shape, b: &Shape, mode: RuleMode) -> Result<Rules, String> {
    let out =
        broadcast_shape(a, b).ok_or_else(|| format!("shapes {a} and {b} do not broadcast"))?;
    if mode == RuleMode::ShapesOnly {
        return Ok(Rules::new(mode, [out]));
    }
    let mut r = Rules::new(mode, [out.clone()]);
    for o in 0..out.ndim() {
        r.push(
            &[split_through(a, &out, o), split_through(b, &out, o)],
            &[Sbp::S(o)],
        );
    }
    r.push(&[B, B], &[B]);
    match op {
        BinaryOp::Add => {
            r.push(&[P, P], &[P]);
            for m in [PMAX, PMIN] {
                r.push(&[m, B], &[m]);
                r.push(&[B, m], &[m]);
            }
        }
        BinaryOp::Sub => {
            r.push(&[P, P], &[P]);
            for (m, flipped) in [(PMAX, PMIN), (PMIN, PMAX)] {
                r.push(&[m, B], &[m]);
                r.push(&[B, m], &[flipped]);
            }
        }
        BinaryOp::Mul => {
            r.push(&[P, B], &[P]);
            r.push(&[B, P], &[P]);
        }
        BinaryOp::Div => r.push(&[P, B], &[P]),
    }
    Ok(r)
}

/// Broadcast x to `shape`: S(i) of a dim that keeps its size -> S(i + offset); B->B; any P->P.
pub fn broadcast_to(x: &Shape, shape: &Shape, mode: RuleMode) -> Result<Rules, String> {
    if broadcast_shape(x, shape).as_ref() != Some(shape) {
        return Err(format!("cannot broadcast {x} to {shape}"));
    }
    let off = shape.ndim() - x.ndim();
    let mut r = Rules::new(mode, [shape.clone()]);
    for i in 0..x.ndim() {
        if x.dim(i) == shape.dim(i + off) {
            r.push(&[Sbp::S(i)], &[Sbp::S(i + off)]);
        }
    }
    r.push(&[B], &[B]);
    for m in PARTIALS {
        r.push(&[m], &[m]);
    }
    Ok(r)
}

/// Sum x down to `shape` (which broadcasts to x): a split of a summed dim gives P, a split of a
/// kept dim stays split; B->B; P->P.
pub fn reduce_to_shape(x: &Shape, shape: &Shape, mode: RuleMode) -> Result<Rules, String> {
    if broadcast_shape(shape, x).as_ref() != Some(x) {
        return Err(format!(
            "cannot sum {x} down to {shape}: {shape} does not broadcast to {x}"
        ));
    }
    let off = x.ndim() - shape.ndim();
    let mut r = Rules::new(mode, [shape.clone()]);
    for i in 0..x.ndim() {
        if i >= off && shape.dim(i - off) == x.dim(i) {
            r.push(&[Sbp::S(i)], &[Sbp::S(i - off)]);
        } else {
            r.push(&[Sbp::S(i)], &[P]);
        }
    }
    r.push(&[B], &[B]);
    r.push(&[P], &[P]);
    Ok(r)
}

/// An op that computes only on whole operands (a fused element-wise program, a multi-tensor
/// optimizer update on global operands): `n_in` inputs and every output broadcast.
pub fn whole(outs: impl IntoIterator<Item = Shape>, n_in: usize, mode: RuleMode) -> Rules {
    let mut r = Rules::new(mode, outs);
    let n_out = r.out_shapes().len();
    r.push_uniform(n_in, n_out, B);
    r
}
