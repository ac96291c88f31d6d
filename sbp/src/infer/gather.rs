//! Candidate tables of indexed reads along one dim (gather, index-select) and their gradients,
//! the scatter-adds (scatter-add, index-add). The dim the indices address may be split: each
//! rank reads only the indices inside its region (offset from the op's local attributes) and
//! contributes zeros elsewhere, so the read is partial, and a scatter-add from whole indices
//! and gradient fills each rank's region of the addressed dim.

use super::{RuleMode, Rules, PARTIALS};
use crate::{Sbp, Shape};

const B: Sbp = Sbp::Broadcast;
const P: Sbp = Sbp::P;

fn check_dim(op: &str, dim: usize, x: &Shape) -> Result<(), String> {
    if dim >= x.ndim() {
        return Err(format!("{op} dim {dim} out of range for {x}"));
    }
    Ok(())
}

/// Index and data agree on every dim but `dim`.
fn check_aligned(op: &str, dim: usize, index: &Shape, x: &Shape) -> Result<(), String> {
    check_dim(op, dim, x)?;
    let aligned =
        index.ndim() == x.ndim() && (0..x.ndim()).all(|d| d == dim || index.dim(d) == x.dim(d));
    if !aligned {
        return Err(format!(
            "{op}: index {index} must have the data's shape {x} on every dim but {dim}"
        ));
    }
    Ok(())
}

/// `x` with dim `dim` set to `n`.
fn with_dim(x: &Shape, dim: usize, n: usize) -> Shape {
    Shape::new(
        x.dims()
            .iter()
            .enumerate()
            .map(|(i, &v)| if i == dim { n } else { v }),
    )
}

/// The last candidates of an indexed read, `operands(x)` placing the data's SBP `x` beside
/// whole indices: the data split on the addressed dim `addressed`->P (each rank reads the
/// indices inside its region); P(op)->P(op); then (B, B)->B.
pub(super) fn push_partial_reads(
    r: &mut Rules,
    addressed: usize,
    operands: impl Fn(Sbp) -> [Sbp; 2],
) {
    r.push(&operands(Sbp::S(addressed)), &[P]);
    for m in PARTIALS {
        r.push(&operands(m), &[m]);
    }
    r.push(&[B, B], &[B]);
}

/// torch.gather (x [..], index [..] of x's shape except on `dim`) -> index's shape:
/// (S(d), S(d))->S(d) for d != dim; (B, S(dim))->S(dim); (S(dim), B)->P (vocabulary split);
/// (P(op), B)->P(op); (B, B)->B.
pub fn gather(dim: usize, x: &Shape, index: &Shape, mode: RuleMode) -> Result<Rules, String> {
    check_aligned("gather", dim, index, x)?;
    let mut r = Rules::new(mode, [index.clone()]);
    for d in (0..x.ndim()).filter(|&d| d != dim) {
        r.push(&[Sbp::S(d), Sbp::S(d)], &[Sbp::S(d)]);
    }
    r.push(&[B, Sbp::S(dim)], &[Sbp::S(dim)]);
    push_partial_reads(&mut r, dim, |x| [x, B]);
    Ok(r)
}

/// The gradient of gather: (index [..], src [..] of index's shape) -> zeros of index's shape
/// with `dim` set to `size`, src added at the indices along `dim`. (S(d), S(d))->S(d) for
/// d != dim; (S(dim), S(dim))->P; (B, B)->S(dim) (each rank fills its region); (B, P)->P;
/// (B, B)->B. `split_first` (the gathered data was split on `dim`) lists (B, B)->S(dim) first
/// and leaves out (B, P)->P, so a partial src is reduced (its size) rather than the output.
pub fn scatter_add(
    dim: usize,
    size: usize,
    index: &Shape,
    src: &Shape,
    split_first: bool,
    mode: RuleMode,
) -> Result<Rules, String> {
    check_dim("scatter_add", dim, index)?;
    if index != src {
        return Err(format!(
            "scatter_add: src {src} must have the index's shape {index}"
        ));
    }
    let mut r = Rules::new(mode, [with_dim(index, dim, size)]);
    push_scatter(&mut r, dim, index.ndim(), split_first, |d| {
        (Sbp::S(d), Sbp::S(d))
    });
    Ok(r)
}

/// The candidates of the scatter-adds; `split_of(d)` is (index, src) split along output dim d.
fn push_scatter(
    r: &mut Rules,
    dim: usize,
    ndim: usize,
    split_first: bool,
    split_of: impl Fn(usize) -> (Sbp, Sbp),
) {
    if split_first {
        r.push(&[B, B], &[Sbp::S(dim)]);
    }
    for d in (0..ndim).filter(|&d| d != dim) {
        let (i, s) = split_of(d);
        r.push(&[i, s], &[Sbp::S(d)]);
    }
    let (i, s) = split_of(dim);
    r.push(&[i, s], &[P]);
    if !split_first {
        r.push(&[B, P], &[P]);
    }
    r.push(&[B, B], &[B]);
    r.push(&[B, B], &[Sbp::S(dim)]);
}

/// index_select (x [..], ids [n]) -> x's shape with `dim` of size n: (S(d), B)->S(d) for
/// d != dim; (B, S(0))->S(dim); (S(dim), B)->P (vocabulary split); (P(op), B)->P(op); (B, B)->B.
pub fn index_select(dim: usize, x: &Shape, ids: &Shape, mode: RuleMode) -> Result<Rules, String> {
    check_dim("index_select", dim, x)?;
    if ids.ndim() != 1 {
        return Err(format!(
            "index_select: ids must be 1-d, got {ids} (data {x})"
        ));
    }
    let mut r = Rules::new(mode, [with_dim(x, dim, ids.dim(0))]);
    for d in (0..x.ndim()).filter(|&d| d != dim) {
        r.push(&[Sbp::S(d), B], &[Sbp::S(d)]);
    }
    r.push(&[B, Sbp::S(0)], &[Sbp::S(dim)]);
    push_partial_reads(&mut r, dim, |x| [x, B]);
    Ok(r)
}

/// The gradient of index_select: (ids [n], src [..] with `dim` of size n) -> src's shape with
/// `dim` of size `size`, src rows added at ids. (B, S(d))->S(d) for d != dim; (S(0), S(dim))->P;
/// (B, B)->S(dim); (B, P)->P; (B, B)->B; `split_first` as in [`scatter_add`].
pub fn index_add(
    dim: usize,
    size: usize,
    ids: &Shape,
    src: &Shape,
    split_first: bool,
    mode: RuleMode,
) -> Result<Rules, String> {
    check_dim("index_add", dim, src)?;
    if ids.ndim() != 1 || ids.dim(0) != src.dim(dim) {
        return Err(format!(
            "index_add: ids must be 1-d of src's size on dim {dim}: ids {ids}, src {src}"
        ));
    }
    let mut r = Rules::new(mode, [with_dim(src, dim, size)]);
    push_scatter(&mut r, dim, src.ndim(), split_first, |d| {
        if d == dim {
            (Sbp::S(0), Sbp::S(dim))
        } else {
            (B, Sbp::S(d))
        }
    });
    Ok(r)
}
