//! Candidate table of reductions (sum, mean, max, min over a set of dims, with keepdim).

use super::{RuleMode, Rules};
use crate::{ReduceOp, Sbp, Shape};

/// Reductions over a set of dims.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub enum ReduceKind {
    Sum,
    /// Sum, then scale by the *global* count of reduced elements: the local kernel of a mean
    /// divides its local sum by the count taken from the global input shape, so a split reduce
    /// dim yields a partial sum of the global mean.
    Mean,
    Max,
    Min,
}

/// S(d) over a reduced dim -> P (sum/mean), P(max) (max), P(min) (min); S(i) over a kept dim ->
/// S(i') (i' after removing the reduced dims unless keepdim); B->B; P->P of the same reduction.
/// No dims (the reduction of a 0-d tensor, or over nothing) is the identity.
pub fn reduce(
    kind: ReduceKind,
    dims: &[usize],
    keepdim: bool,
    x: &Shape,
    mode: RuleMode,
) -> Result<Rules, String> {
    if dims.windows(2).any(|w| w[0] >= w[1]) || dims.iter().any(|&d| d >= x.ndim()) {
        return Err(format!(
            "reduce dims {dims:?} must be sorted, distinct and below the input's {} dims (input {x})",
            x.ndim()
        ));
    }
    let out: Vec<usize> = if keepdim {
        (0..x.ndim())
            .map(|i| if dims.contains(&i) { 1 } else { x.dim(i) })
            .collect()
    } else {
        (0..x.ndim())
            .filter(|i| !dims.contains(i))
            .map(|i| x.dim(i))
            .collect()
    };
    let partial = Sbp::Partial(match kind {
        ReduceKind::Sum | ReduceKind::Mean => ReduceOp::Sum,
        ReduceKind::Max => ReduceOp::Max,
        ReduceKind::Min => ReduceOp::Min,
    });
    let mut r = Rules::new(mode, [Shape::new(out)]);
    for i in 0..x.ndim() {
        if dims.contains(&i) {
            r.push(&[Sbp::S(i)], &[partial]);
        } else {
            let j = if keepdim {
                i
            } else {
                i - dims.iter().filter(|&&d| d < i).count()
            };
            r.push(&[Sbp::S(i)], &[Sbp::S(j)]);
        }
    }
    r.push(&[Sbp::Broadcast], &[Sbp::Broadcast]);
    r.push(&[partial], &[partial]);
    Ok(r)
}

/// The index of the largest element along `dim` (the dim removed): S(i) over another dim ->
/// S(i'), B -> B; the searched dim must be whole (its split has no partial form).
pub fn arg_reduce(dim: usize, x: &Shape, mode: RuleMode) -> Result<Rules, String> {
    if dim >= x.ndim() {
        return Err(format!("dim {dim} is not a dim of input {x}"));
    }
    let out: Vec<usize> = (0..x.ndim())
        .filter(|&i| i != dim)
        .map(|i| x.dim(i))
        .collect();
    let mut r = Rules::new(mode, [Shape::new(out)]);
    for i in (0..x.ndim()).filter(|&i| i != dim) {
        r.push(&[Sbp::S(i)], &[Sbp::S(if i < dim { i } else { i - 1 })]);
    }
    r.push(&[Sbp::B], &[Sbp::B]);
    Ok(r)
}

/// The per-tensor sums of squares of `xs` -> (sums `[len]`, total `[]`): all whole, and for
/// each entry of `splits` (one dim per input) that fits, every input split on its dim -> both
/// partial sums.
pub fn sum_squares(xs: &[&Shape], splits: &[Vec<usize>], mode: RuleMode) -> Rules {
    let mut r = Rules::new(mode, [Shape::from(&[xs.len()][..]), Shape::scalar()]);
    r.push_uniform(xs.len(), 2, Sbp::B);
    for dims in splits {
        let fits = dims.len() == xs.len() && dims.iter().zip(xs).all(|(&k, sh)| k < sh.ndim());
        if fits {
            let ins: Vec<Sbp> = dims.iter().map(|&k| Sbp::S(k)).collect();
            r.push(&ins, &[Sbp::P, Sbp::P]);
        }
    }
    r
}
