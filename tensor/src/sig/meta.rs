//! Shape and dtype inference of every op: the metadata checks that run before any communication.

use oxiflow_collectives::DType;
use oxiflow_sbp::Shape;

use crate::op::{Op, ScalarOp, UnaryOp};

/// Why metadata does not fit an op.
#[derive(Debug)]
pub enum MetaError {
    Shape(String),
    DType(String),
}

type MetaResult = Result<(Shape, DType), MetaError>;

fn shape_err<T>(s: String) -> Result<T, MetaError> {
    Err(MetaError::Shape(s))
}

/// Broadcast two shapes (numpy rules, aligned from the right).
pub fn broadcast_shapes(a: &Shape, b: &Shape) -> Option<Shape> {
    let n = a.ndim().max(b.ndim());
    let mut out = Vec::with_capacity(n);
    for i in 0..n {
        let da = if i + a.ndim() >= n {
            a.dim(i + a.ndim() - n)
        } else {
            1
        };
        let db = if i + b.ndim() >= n {
            b.dim(i + b.ndim() - n)
        } else {
            1
        };
        out.push(match (da, db) {
            (x, y) if x == y => x,
            (1, y) => y,
            (x, 1) => x,
            _ => return None,
        });
    }
    Some(Shape::new(out))
}

fn reduced(shape: &Shape, dims: &[usize], keepdim: bool) -> Result<Shape, MetaError> {
    for &d in dims {
        if d >= shape.ndim() {
            return shape_err(format!("dim {d} out of range for {} dims", shape.ndim()));
        }
    }
    Ok(Shape::new((0..shape.ndim()).filter_map(|d| {
        if dims.contains(&d) {
            keepdim.then_some(1)
        } else {
            Some(shape.dim(d))
        }
    })))
}

fn need_float(dt: DType, what: &str) -> Result<(), MetaError> {
    if dt.is_float() {
        Ok(())
    } else {
        Err(MetaError::DType(format!(
            "{what} must be a float dtype, got {dt}"
        )))
    }
}

fn same_dtype(dtypes: &[DType]) -> Result<DType, MetaError> {
    let d = dtypes[0];
    if dtypes.iter().any(|&x| x != d) {
        return Err(MetaError::DType("operands must have the same dtype".into()));
    }
    Ok(d)
}

fn dim_ok(shape: &Shape, d: usize) -> Result<(), MetaError> {
    if d >= shape.ndim() {
        return shape_err(format!("dim {d} out of range for {} dims", shape.ndim()));
    }
    Ok(())
}

/// Number of inputs `op` takes (min, max).
pub fn arity(op: &Op) -> (usize, usize) {
    match op {
        Op::Binary(_) | Op::MatMul | Op::BatchMatMul | Op::Embedding | Op::CrossEntropy => (2, 2),
        Op::UnaryBackward(_) | Op::SoftmaxBackward { .. } | Op::LogSoftmaxBackward { .. } => (2, 2),
        Op::EmbeddingBackward { .. } => (2, 2),
        Op::CrossEntropyBackward => (3, 3),
        Op::LayerNorm { .. } | Op::LayerNormBackward { .. } => (3, 3),
        Op::Concat { .. } => (1, usize::MAX),
        _ => (1, 1),
    }
}

/// Output (global or local) shape and dtype of `op` on inputs of `shapes` and `dtypes`.
pub fn infer_meta(op: &Op, shapes: &[&Shape], dtypes: &[DType]) -> MetaResult {
    let (lo, hi) = arity(op);
    if shapes.len() < lo || shapes.len() > hi {
        return shape_err(format!("takes {lo}..={hi} inputs, got {}", shapes.len()));
    }
    let s0 = shapes[0];
    let d0 = dtypes[0];
    match op {
        Op::Unary(u) => {
            if *u != UnaryOp::Neg && *u != UnaryOp::Abs && *u != UnaryOp::Square {
                need_float(d0, "input")?;
            }
            Ok((s0.clone(), d0))
        }
        Op::Scalar(s, _) => {
            if matches!(s, ScalarOp::RDiv | ScalarOp::Pow) {
                need_float(d0, "input")?;
            }
            Ok((s0.clone(), d0))
        }
        Op::Cast(dt) => Ok((s0.clone(), *dt)),
        Op::Binary(_) => {
            let dt = same_dtype(dtypes)?;
            match broadcast_shapes(s0, shapes[1]) {
                Some(s) => Ok((s, dt)),
                None => shape_err(format!("shapes {} and {} do not broadcast", s0, shapes[1])),
            }
        }
        Op::MatMul => {
            let dt = same_dtype(dtypes)?;
            let b = shapes[1];
            if s0.ndim() < 1 || b.ndim() != 2 {
                return shape_err("needs a [.., k] and b [k, n]".into());
            }
            if s0.dim(s0.ndim() - 1) != b.dim(0) {
                return shape_err(format!(
                    "inner dims differ: a has k = {}, b has k = {}",
                    s0.dim(s0.ndim() - 1),
                    b.dim(0)
                ));
            }
            let mut out = s0.to_vec();
            let last = out.len() - 1;
            out[last] = b.dim(1);
            Ok((Shape::new(out), dt))
        }
        Op::BatchMatMul => {
            let dt = same_dtype(dtypes)?;
            let b = shapes[1];
            let n = s0.ndim();
            if n < 3 || b.ndim() != n || s0.dims()[..n - 2] != b.dims()[..n - 2] {
                return shape_err(
                    "needs a [b.., m, k], b [b.., k, n] with equal batch dims".into(),
                );
            }
            if s0.dim(n - 1) != b.dim(n - 2) {
                return shape_err(format!(
                    "inner dims differ: {} vs {}",
                    s0.dim(n - 1),
                    b.dim(n - 2)
                ));
            }
            Ok((s0.with_dim(n - 1, b.dim(n - 1)), dt))
        }
        Op::Sum { dims, keepdim } | Op::Max { dims, keepdim } => {
            Ok((reduced(s0, dims, *keepdim)?, d0))
        }
        Op::Mean { dims, keepdim, .. } => {
            need_float(d0, "input")?;
            Ok((reduced(s0, dims, *keepdim)?, d0))
        }
        Op::Softmax { dim } | Op::LogSoftmax { dim } => {
            need_float(d0, "input")?;
            dim_ok(s0, *dim)?;
            Ok((s0.clone(), d0))
        }
        Op::Permute { perm } => {
            let mut seen = vec![false; s0.ndim()];
            if perm.len() != s0.ndim() {
                return shape_err(format!(
                    "permutation {perm:?} has {} dims, input {}",
                    perm.len(),
                    s0.ndim()
                ));
            }
            for &p in perm {
                if p >= s0.ndim() || seen[p] {
                    return shape_err(format!(
                        "{perm:?} is not a permutation of {} dims",
                        s0.ndim()
                    ));
                }
                seen[p] = true;
            }
            Ok((Shape::new(perm.iter().map(|&p| s0.dim(p))), d0))
        }
        Op::Reshape { shape } => {
            if shape.numel() != s0.numel() {
                return shape_err(format!(
                    "cannot reshape {} ({} elements) to {}",
                    s0,
                    s0.numel(),
                    shape
                ));
            }
            Ok((shape.clone(), d0))
        }
        Op::Concat { dim } => {
            let dt = same_dtype(dtypes)?;
            dim_ok(s0, *dim)?;
            let mut total = 0;
            for s in shapes {
                let same = s.ndim() == s0.ndim()
                    && (0..s0.ndim()).all(|d| d == *dim || s.dim(d) == s0.dim(d));
                if !same {
                    return shape_err(format!("shapes {} and {} differ outside dim {dim}", s0, s));
                }
                total += s.dim(*dim);
            }
            Ok((s0.with_dim(*dim, total), dt))
        }
        Op::Narrow { dim, start, len } => {
            dim_ok(s0, *dim)?;
            if start + len > s0.dim(*dim) {
                return shape_err(format!(
                    "range {start}..{} out of bounds for dim {dim} of size {}",
                    start + len,
                    s0.dim(*dim)
                ));
            }
            Ok((s0.with_dim(*dim, *len), d0))
        }
        Op::Embedding => {
            let (ids, w) = (s0, shapes[1]);
            if w.ndim() != 2 {
                return shape_err(format!("weight must be [num, dim], got {w}"));
            }
            if d0 != DType::I64 {
                return Err(MetaError::DType(format!("ids must be i64, got {d0}")));
            }
            need_float(dtypes[1], "weight")?;
            let mut out = ids.to_vec();
            out.push(w.dim(1));
            Ok((Shape::new(out), dtypes[1]))
        }
        Op::LayerNorm { .. } | Op::LayerNormBackward { .. } => {
            need_float(d0, "input")?;
            let dt = same_dtype(dtypes)?;
            if s0.ndim() == 0 {
                return shape_err("input needs at least one dim".into());
            }
            let h = s0.dim(s0.ndim() - 1);
            if shapes[1].dims() != [h] {
                return shape_err(format!("weight must be [{h}], got {}", shapes[1]));
            }
            if matches!(op, Op::LayerNorm { .. }) && shapes[2].dims() != [h] {
                return shape_err(format!("bias must be [{h}], got {}", shapes[2]));
            }
            if matches!(op, Op::LayerNormBackward { .. }) && shapes[2] != s0 {
                return shape_err(format!("dy {} and x {} differ", shapes[2], s0));
            }
            Ok((s0.clone(), dt))
        }
        Op::CrossEntropy => {
            need_float(d0, "logits")?;
            let l = shapes[1];
            if s0.ndim() != 2 || l.ndim() != 1 || l.dim(0) != s0.dim(0) {
                return shape_err("needs logits [n, c] and labels [n]".into());
            }
            if dtypes[1] != DType::I64 {
                return Err(MetaError::DType(format!(
                    "labels must be i64, got {}",
                    dtypes[1]
                )));
            }
            Ok((Shape::new([s0.dim(0)]), d0))
        }
        Op::UnaryBackward(_) | Op::SoftmaxBackward { .. } | Op::LogSoftmaxBackward { .. } => {
            let dt = same_dtype(dtypes)?;
            need_float(dt, "input")?;
            if s0 != shapes[1] {
                return shape_err(format!(
                    "dy and the saved tensor differ: {} vs {}",
                    s0, shapes[1]
                ));
            }
            if let Op::SoftmaxBackward { dim } | Op::LogSoftmaxBackward { dim } = op {
                dim_ok(s0, *dim)?;
            }
            Ok((s0.clone(), dt))
        }
        Op::SumToShape { shape } => {
            match broadcast_shapes(shape, s0) {
                Some(b) if &b == s0 => {}
                _ => return shape_err(format!("{} does not broadcast from {}", s0, shape)),
            }
            Ok((shape.clone(), d0))
        }
        Op::EmbeddingBackward { num } => {
            let (ids, dy) = (s0, shapes[1]);
            if d0 != DType::I64 {
                return Err(MetaError::DType(format!("ids must be i64, got {d0}")));
            }
            need_float(dtypes[1], "dy")?;
            if dy.ndim() != ids.ndim() + 1 || dy.dims()[..ids.ndim()] != *ids.dims() {
                return shape_err(format!(
                    "dy {} does not match ids {} plus a hidden dim",
                    dy, ids
                ));
            }
            Ok((Shape::new([*num, dy.dim(dy.ndim() - 1)]), dtypes[1]))
        }
        Op::CrossEntropyBackward => {
            let (lg, lb, dy) = (s0, shapes[1], shapes[2]);
            if lg.ndim() != 2 || dy.dims() != [lg.dim(0)] || lb.dims() != [lg.dim(0)] {
                return shape_err("needs dy [n], logits [n, c], labels [n]".into());
            }
            if dtypes[0] != dtypes[2] || !dtypes[0].is_float() || dtypes[1] != DType::I64 {
                return Err(MetaError::DType(
                    "needs float logits and dy of one dtype, i64 labels".into(),
                ));
            }
            Ok((lg.clone(), d0))
        }
    }
}
