//! Candidate tables of the fused linear layers: `x W + b` (optionally with its GELU), its weight
//! gradient, the residual MLP block and its backward, and the linear classifier (the output
//! table's logits and the loss in one op) with its backward. The callers check the shapes and
//! pass the output shapes; these say how each op runs on every mesh axis.

use super::{RuleMode, Rules};
use crate::{Sbp, Shape};

const B: Sbp = Sbp::Broadcast;
const P: Sbp = Sbp::P;

/// `y = x W (+ b)` with `outs` outputs of shape `y` (the pre-activation beside a GELU's output):
/// rows split on a leading dim of x `[.., K]` (W, b broadcast) -> rows split; W split on its
/// output features (b alike) -> the last dim split (column-parallel); all broadcast. Never a
/// partial sum: the bias and GELU are not linear in one.
pub fn linear(x: &Shape, bias: bool, y: Shape, outs: usize, mode: RuleMode) -> Rules {
    let last = x.ndim().saturating_sub(1);
    let mut r = Rules::new(mode, std::iter::repeat_n(y, outs));
    let ins = |xs: Sbp, ws: Sbp, bs: Sbp| {
        let mut v = vec![xs, ws];
        v.extend(bias.then_some(bs));
        v
    };
    for i in 0..last {
        r.push(&ins(Sbp::S(i), B, B), &vec![Sbp::S(i); outs]);
    }
    r.push(&ins(B, Sbp::S(1), Sbp::S(0)), &vec![Sbp::S(last); outs]);
    r.push(&ins(B, B, B), &vec![B; outs]);
    r
}

/// (x `[.., K]`, dpre `[.., N]`) -> dW `[K, N]` (and db `[N]`, the last of `outs`): rows split
/// -> partial sums over the row shards; dpre's features split -> dW S(1), db S(0); x's features
/// split -> dW S(0), db whole; a partial dpre -> partial; all broadcast.
pub fn linear_weight_grad(x: &Shape, outs: Vec<Shape>, mode: RuleMode) -> Rules {
    let last = x.ndim().saturating_sub(1);
    let m = outs.len();
    let mut r = Rules::new(mode, outs);
    let pick = |dw: Sbp, db: Sbp| [dw, db][..m].to_vec();
    for i in 0..last {
        r.push(&[Sbp::S(i), Sbp::S(i)], &pick(P, P));
    }
    r.push(&[B, Sbp::S(last)], &pick(Sbp::S(1), Sbp::S(0)));
    r.push(&[Sbp::S(last), B], &pick(Sbp::S(0), B));
    r.push(&[B, P], &pick(P, P));
    r.push(&[B, B], &pick(B, B));
    r
}

/// The residual MLP block (x, w_fc, b_fc, w_proj, b_proj, residual) -> (y, h, pre): rows split
/// alike on a leading dim of x with the weights broadcast, or everything whole.
pub fn residual_mlp(x: &Shape, hidden: &Shape, mode: RuleMode) -> Rules {
    let mut r = Rules::new(mode, [x.clone(), hidden.clone(), hidden.clone()]);
    for i in 0..x.ndim().saturating_sub(1) {
        r.push(&[Sbp::S(i), B, B, B, B, Sbp::S(i)], &[Sbp::S(i); 3]);
    }
    r.push(&[B; 6], &[B; 3]);
    r
}

/// Its backward (x, h, pre, w_fc, w_proj, dy) -> (dx, dw_fc, db_fc, dw_proj, db_proj): rows
/// split -> dx split, the parameter gradients partial; all whole; linear in dy.
pub fn residual_mlp_backward(x: &Shape, outs: [Shape; 5], mode: RuleMode) -> Rules {
    let mut r = Rules::new(mode, outs);
    for i in 0..x.ndim().saturating_sub(1) {
        let si = Sbp::S(i);
        r.push(&[si, si, si, B, B, si], &[si, P, P, P, P]);
    }
    r.push(&[B; 6], &[B; 5]);
    r.push(&[B, B, B, B, B, P], &[P; 5]);
    r
}

/// The linear classifier (x `[N, C]`, table `[V, C]`, targets `[N]`) -> (loss, dx, dtable):
/// rows split -> the loss and the table's gradient partial sums; all whole. Never P inputs (the
/// softmax is not linear) and the classes whole.
pub fn linear_classifier(n: usize, c: usize, v: usize, mode: RuleMode) -> Rules {
    let mut r = Rules::new(
        mode,
        [Shape::scalar(), Shape::new([n, c]), Shape::new([v, c])],
    );
    r.push(&[Sbp::S(0), B, Sbp::S(0)], &[P, Sbp::S(0), P]);
    r.push(&[B, B, B], &[B, B, B]);
    r
}

/// Its backward (dx, dtable, dloss) -> the two scaled by dloss: rows split with the table's
/// gradient partial; all whole; linear in dloss.
pub fn linear_classifier_backward(dx: &Shape, dw: &Shape, mode: RuleMode) -> Rules {
    let mut r = Rules::new(mode, [dx.clone(), dw.clone()]);
    r.push(&[Sbp::S(0), P, B], &[Sbp::S(0), P]);
    r.push(&[B, B, B], &[B, B]);
    r.push(&[B, B, P], &[P, P]);
    r
}
