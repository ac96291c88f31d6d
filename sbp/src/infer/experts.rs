//! Candidate tables of the mixture-of-experts ops: the routed product of token rows with
//! their experts' matrices, its weight gradient, the router's top-k selection, and the routed
//! SwiGLU experts whose rows travel to the ranks holding their experts. Rows are independent
//! (each row reads only its own expert id), so splitting the rows splits the result; the
//! experts' matrices split like a matmul's right operand, or (stacked `[experts, ..]`) by
//! expert, where rows and experts split on one mesh axis mean an exchange of rows over it.

use super::{RuleMode, Rules};
use crate::{Sbp, Shape};

const B: Sbp = Sbp::Broadcast;
const P: Sbp = Sbp::P;

/// Inputs `x`, `ids` and `experts` matrices, with the matrices all `w`.
fn ins(x: Sbp, ids: Sbp, w: Sbp, experts: usize) -> Vec<Sbp> {
    let mut v = vec![x, ids];
    v.extend(std::iter::repeat_n(w, experts));
    v
}

/// Checks `ids [M]` against rows `[M, ..]` of `x` and `experts` matrices of one shape `[k, n]`.
fn check(op: &str, x: &Shape, ids: &Shape, ws: &[&Shape]) -> Result<(usize, usize), String> {
    let Some(&w0) = ws.first() else {
        return Err(format!("{op} needs at least one expert matrix"));
    };
    if let Some(w) = ws.iter().find(|w| **w != w0) {
        return Err(format!(
            "{op}: expert matrices have different shapes {w0} and {w}"
        ));
    }
    if x.ndim() != 2 || ids.ndim() != 1 || ids.dim(0) != x.dim(0) || w0.ndim() != 2 {
        return Err(format!(
            "{op} needs rows x [m, k], expert ids [m] and matrices [k, n], got x {x}, ids {ids} \
             and matrices {w0}"
        ));
    }
    Ok((w0.dim(0), w0.dim(1)))
}

/// `y[m] = x[m] @ w[ids[m]]` (x `[m, k]`, ids `[m]`, each w `[k, n]`; `transposed`:
/// `x [m, n]`, `y[m] = x[m] @ w[ids[m]]^T` `[m, k]`): rows (S(0), S(0), B) -> S(0); the
/// matrices' free dim split -> the output's last dim split; the contraction split on both
/// -> P; a partial x or partial matrices (linear in each) -> P; all B -> B.
pub fn expert_matmul(
    x: &Shape,
    ids: &Shape,
    ws: &[&Shape],
    transposed: bool,
    mode: RuleMode,
) -> Result<Rules, String> {
    let (k, n) = check("expert_matmul", x, ids, ws)?;
    let (inner, outer) = if transposed { (n, k) } else { (k, n) };
    if x.dim(1) != inner {
        return Err(format!(
            "expert_matmul: rows x {x} do not match the matrices [{k}, {n}]{}",
            if transposed { " transposed" } else { "" }
        ));
    }
    let e = ws.len();
    let mut r = Rules::new(mode, [Shape::new([x.dim(0), outer])]);
    // The matrices' dim that is the output's columns, and the contracted one.
    let (free, contracted) = if transposed { (0, 1) } else { (1, 0) };
    r.push(&ins(Sbp::S(0), Sbp::S(0), B, e), &[Sbp::S(0)]);
    r.push(&ins(B, B, Sbp::S(free), e), &[Sbp::S(1)]);
    r.push(&ins(Sbp::S(1), B, Sbp::S(contracted), e), &[P]);
    r.push(&ins(P, B, B, e), &[P]);
    r.push(&ins(B, B, P, e), &[P]);
    r.push(&ins(B, B, B, e), &[B]);
    Ok(r)
}

/// The weight gradients of [`expert_matmul`]: `g[e] = sum over rows m with ids[m] = e of
/// a[m]^T b[m]` (a `[m, k]`, ids `[m]`, b `[m, n]`; `experts` outputs `[k, n]`): rows split
/// on all three -> P; b's columns split -> S(1); a's columns split -> S(0); a partial a or b
/// -> P; all B -> B.
pub fn expert_matmul_wgrad(
    a: &Shape,
    ids: &Shape,
    b: &Shape,
    experts: usize,
    mode: RuleMode,
) -> Result<Rules, String> {
    if a.ndim() != 2 || b.ndim() != 2 || ids.ndim() != 1 {
        return Err(format!(
            "expert_matmul_wgrad needs a [m, k], ids [m] and b [m, n], got {a}, {ids} and {b}"
        ));
    }
    if a.dim(0) != b.dim(0) || ids.dim(0) != a.dim(0) || experts == 0 {
        return Err(format!(
            "expert_matmul_wgrad: rows of a {a}, ids {ids} and b {b} differ, or no experts \
             ({experts})"
        ));
    }
    let w = Shape::new([a.dim(1), b.dim(1)]);
    let mut r = Rules::new(mode, std::iter::repeat_n(w, experts));
    let outs = |s: Sbp| vec![s; experts];
    r.push(&[Sbp::S(0), Sbp::S(0), Sbp::S(0)], &outs(P));
    r.push(&[B, B, Sbp::S(1)], &outs(Sbp::S(1)));
    r.push(&[Sbp::S(1), B, B], &outs(Sbp::S(0)));
    r.push(&[P, B, B], &outs(P));
    r.push(&[B, B, P], &outs(P));
    r.push(&[B, B, B], &outs(B));
    Ok(r)
}

/// The router's top-k of probabilities `[m, e]`: ids `[m, k]` and the count of rows routed
/// to each expert `[e]`. Rows split -> (ids split, counts P); all B -> B.
pub fn router_topk(probs: &Shape, k: usize, mode: RuleMode) -> Result<Rules, String> {
    if probs.ndim() != 2 || k == 0 || k > probs.dim(1) {
        return Err(format!(
            "router_topk needs probabilities [m, experts] and 1 <= k <= experts, got {probs} \
             and k {k}"
        ));
    }
    let mut r = Rules::new(
        mode,
        [Shape::new([probs.dim(0), k]), Shape::new([probs.dim(1)])],
    );
    r.push(&[Sbp::S(0)], &[Sbp::S(0), P]);
    r.push(&[B], &[B, B]);
    Ok(r)
}

/// Checks the routed experts' operands: rows x `[m, c]`, ids `[m]`, gate and up `[e, c, f]`,
/// down `[e, f, c]`; returns `[m, c]`.
fn check_routed(op: &str, s: &[&Shape]) -> Result<Shape, String> {
    let [x, ids, gate, up, down, ..] = s else {
        return Err(format!(
            "{op} needs x, ids, gate, up and down, got {} inputs",
            s.len()
        ));
    };
    let fits = x.ndim() == 2
        && ids.ndim() == 1
        && ids.dim(0) == x.dim(0)
        && gate.ndim() == 3
        && up == gate
        && gate.dim(1) == x.dim(1)
        && **down == Shape::new([gate.dim(0), gate.dim(2), x.dim(1)])
        && gate.dim(0) > 0;
    if !fits {
        return Err(format!(
            "{op} needs rows x [m, c], expert ids [m], gate and up [experts, c, f] and down \
             [experts, f, c] (at least one expert), got x {x}, ids {ids}, gate {gate}, up {up} \
             and down {down}"
        ));
    }
    Ok((*x).clone())
}

/// The routed SwiGLU experts `y[m] = swiglu(x[m] gate[e], x[m] up[e]) down[e]` with
/// `e = ids[m]` (inputs x `[m, c]`, ids `[m]`, gate and up `[e, c, f]`, down `[e, f, c]`),
/// per mesh axis: rows and experts split (S(0) on all) -> S(0), the rows going to the ranks
/// of their experts and back; rows split, experts whole -> S(0); each expert's hidden columns
/// split (gate, up S(2), down S(1)) -> P; all B -> B. The output is not linear in x: no
/// partial x.
pub fn routed_experts(s: &[&Shape], mode: RuleMode) -> Result<Rules, String> {
    let y = check_routed("routed_experts", s)?;
    let s0 = Sbp::S(0);
    let mut r = Rules::new(mode, [y]);
    r.push(&[s0, s0, s0, s0, s0], &[s0]);
    r.push(&[s0, s0, B, B, B], &[s0]);
    r.push(&[B, B, Sbp::S(2), Sbp::S(2), Sbp::S(1)], &[P]);
    r.push(&[B, B, B, B, B], &[B]);
    Ok(r)
}

/// The gradients of [`routed_experts`] (inputs x, ids, gate, up, down and dy `[m, c]`;
/// outputs dx, dgate, dup, ddown): rows and experts split -> (S(0), S(0), S(0), S(0)) (each
/// expert's rows all reach its rank); rows split, experts whole -> (S(0), P, P, P); hidden
/// columns split -> (P, S(2), S(2), S(1)); a partial dy (every gradient is linear in it) ->
/// P; all B -> B.
pub fn routed_experts_backward(s: &[&Shape], mode: RuleMode) -> Result<Rules, String> {
    let y = check_routed("routed_experts_backward", s)?;
    match s.get(5) {
        Some(dy) if **dy == y => {}
        dy => {
            return Err(format!(
                "routed_experts_backward: dy {dy:?} must have the output's shape {y}"
            ))
        }
    }
    let (s0, s1, s2) = (Sbp::S(0), Sbp::S(1), Sbp::S(2));
    let mut r = Rules::new(mode, [y, (*s[2]).clone(), (*s[3]).clone(), (*s[4]).clone()]);
    r.push(&[s0, s0, s0, s0, s0, s0], &[s0, s0, s0, s0]);
    r.push(&[s0, s0, B, B, B, s0], &[s0, P, P, P]);
    r.push(&[B, B, s2, s2, s1, B], &[P, s2, s2, s1]);
    r.push(&[B, B, B, B, B, P], &[P, P, P, P]);
    r.push(&[B, B, B, B, B, B], &[B, B, B, B]);
    Ok(r)
}
