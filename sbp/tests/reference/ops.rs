//! The reference ops on plain arrays, written from their definitions (no SBP knowledge).

use oxiflow_sbp::{BinaryOp, ReduceKind};

use super::op::RuleCall;

use super::arr::{numel, unravel, Arr};
use super::Starts;

/// The linear and the non-linear unary function the tests use for `Unary`.
pub fn unary_fn(linear: bool) -> fn(f64) -> f64 {
    if linear {
        |x| -1.5 * x
    } else {
        |x| x.tanh() + x * x
    }
}

/// Runs `op` on `inputs`. `out_shapes` are the shapes the outputs must have (on a rank: its
/// local output shapes; reshape-like ops take their target from them) and `global_in` the
/// global input shapes (mean divides by the global count); `starts` where the pieces sit (the
/// embedding's vocabulary offset).
pub fn run(
    op: &RuleCall,
    x: &[Arr],
    out_shapes: &[Vec<usize>],
    global_in: &[Vec<usize>],
    starts: &Starts,
) -> Result<Vec<Arr>, String> {
    let one = |a: Arr| Ok(vec![a]);
    match op {
        RuleCall::MatMul | RuleCall::BatchMatMul => one(matmul(&x[0], &x[1])),
        RuleCall::Unary { linear } => one(x[0].map(unary_fn(*linear))),
        RuleCall::Binary(b) => {
            let f: fn(f64, f64) -> f64 = match b {
                BinaryOp::Add => |a, b| a + b,
                BinaryOp::Sub => |a, b| a - b,
                BinaryOp::Mul => |a, b| a * b,
                BinaryOp::Div => |a, b| a / b,
            };
            one(broadcast_zip(&x[0], &x[1], f))
        }
        RuleCall::Reduce {
            kind,
            dims,
            keepdim,
        } => {
            let count: usize = dims.iter().map(|&d| global_in[0][d]).product();
            one(reduce(&x[0], *kind, dims, *keepdim, count))
        }
        RuleCall::ReduceToShape { .. } => one(reduce_to_shape(&x[0], &out_shapes[0])),
        RuleCall::BroadcastTo { .. } => one(broadcast_to(&x[0], &out_shapes[0])),
        RuleCall::Softmax { dim } => one(softmax(&x[0], *dim, false)),
        RuleCall::LogSoftmax { dim } => one(softmax(&x[0], *dim, true)),
        RuleCall::SoftmaxBackward { dim } => {
            // dx = y * (dy - sum(dy * y))
            let s = sum_keep(&x[1].zip(&x[0], |a, b| a * b)?, *dim);
            let t = broadcast_zip(&x[1], &s, |a, b| a - b);
            one(x[0].zip(&t, |a, b| a * b)?)
        }
        RuleCall::LogSoftmaxBackward { dim } => {
            // dx = dy - exp(y) * sum(dy)
            let s = sum_keep(&x[1], *dim);
            let t = broadcast_zip(&x[0].map(f64::exp), &s, |a, b| a * b);
            one(x[1].zip(&t, |a, b| a - b)?)
        }
        RuleCall::Permute { perm } => one(permute(&x[0], perm)),
        RuleCall::Reshape { .. } => {
            if numel(&out_shapes[0]) != x[0].data.len() {
                return Err(format!(
                    "local reshape of {:?} to {:?}",
                    x[0].shape, out_shapes[0]
                ));
            }
            one(Arr::new(out_shapes[0].clone(), x[0].data.clone()))
        }
        RuleCall::Concat { dim } => one(super::arr::concat(x, *dim)?),
        RuleCall::Slice { dim, start, end } => one(x[0].narrow(*dim, *start..*end)),
        RuleCall::Embedding => one(embedding(&x[0], &x[1], starts.inputs[1][0])),
        RuleCall::EmbeddingBackward { .. } => one(embedding_backward(
            &x[0],
            &x[1],
            &out_shapes[0],
            starts.outputs[0][0],
        )),
        RuleCall::LayerNorm { normalized_dims } => {
            Ok(layer_norm(&x[0], &x[1], &x[2], *normalized_dims))
        }
        RuleCall::LayerNormBackward { normalized_dims } => one(layer_norm_backward(
            &x[0],
            &x[1],
            &x[2],
            (&x[3], &x[4]),
            *normalized_dims,
        )),
        RuleCall::CrossEntropy => one(cross_entropy(&x[0], &x[1])),
        RuleCall::CrossEntropyBackward => one(cross_entropy_backward(&x[0], &x[1], &x[2])),
        RuleCall::Gather { dim } => one(read_at(&x[0], &x[1], *dim, true, starts.inputs[0][*dim])),
        RuleCall::IndexSelect { dim } => {
            one(read_at(&x[0], &x[1], *dim, false, starts.inputs[0][*dim]))
        }
        RuleCall::ScatterAdd { dim, .. } | RuleCall::IndexAdd { dim, .. } => one(add_at(
            &x[0],
            &x[1],
            *dim,
            matches!(op, RuleCall::ScatterAdd { .. }),
            &out_shapes[0],
            starts.outputs[0][*dim],
        )),
    }
}

/// `[..batch, m, k] @ [..batch, k, n]`.
fn matmul(a: &Arr, b: &Arr) -> Arr {
    let n = a.ndim();
    let (m, k, nn) = (a.shape[n - 2], a.shape[n - 1], b.shape[n - 1]);
    let mut shape = a.shape[..n - 2].to_vec();
    shape.extend([m, nn]);
    let batch = numel(&a.shape[..n - 2]);
    let mut out = Vec::with_capacity(numel(&shape));
    for bt in 0..batch {
        for i in 0..m {
            for j in 0..nn {
                let s: f64 = (0..k)
                    .map(|l| a.data[bt * m * k + i * k + l] * b.data[bt * k * nn + l * nn + j])
                    .sum();
                out.push(s);
            }
        }
    }
    Arr::new(shape, out)
}

/// Index into `x` for output index `idx` under numpy broadcasting.
fn bcast_index(x: &Arr, idx: &[usize]) -> Vec<usize> {
    let off = idx.len() - x.ndim();
    (0..x.ndim())
        .map(|i| if x.shape[i] == 1 { 0 } else { idx[i + off] })
        .collect()
}

fn broadcast_zip(a: &Arr, b: &Arr, f: fn(f64, f64) -> f64) -> Arr {
    let n = a.ndim().max(b.ndim());
    let dim = |x: &Arr, o: usize| {
        if o < n - x.ndim() {
            1
        } else {
            x.shape[o - (n - x.ndim())]
        }
    };
    let shape: Vec<usize> = (0..n)
        .map(|o| if dim(a, o) == 1 { dim(b, o) } else { dim(a, o) })
        .collect();
    let data = (0..numel(&shape))
        .map(|fl| {
            let idx = unravel(fl, &shape);
            f(a.at(&bcast_index(a, &idx)), b.at(&bcast_index(b, &idx)))
        })
        .collect();
    Arr::new(shape, data)
}

fn broadcast_to(x: &Arr, shape: &[usize]) -> Arr {
    let data = (0..numel(shape))
        .map(|fl| x.at(&bcast_index(x, &unravel(fl, shape))))
        .collect();
    Arr::new(shape.to_vec(), data)
}

/// Reduce `dims` with keepdim; mean divides by `count`.
fn reduce(x: &Arr, kind: ReduceKind, dims: &[usize], keepdim: bool, count: usize) -> Arr {
    let kept: Vec<usize> = (0..x.ndim())
        .map(|i| if dims.contains(&i) { 1 } else { x.shape[i] })
        .collect();
    let init = match kind {
        ReduceKind::Sum | ReduceKind::Mean => 0.0,
        ReduceKind::Max => f64::NEG_INFINITY,
        ReduceKind::Min => f64::INFINITY,
    };
    let mut acc = Arr::full(&kept, init);
    for fl in 0..x.data.len() {
        let idx = unravel(fl, &x.shape);
        let o: Vec<usize> = idx
            .iter()
            .enumerate()
            .map(|(i, &v)| if dims.contains(&i) { 0 } else { v })
            .collect();
        let off = acc.offset(&o);
        let v = x.data[fl];
        acc.data[off] = match kind {
            ReduceKind::Sum | ReduceKind::Mean => acc.data[off] + v,
            ReduceKind::Max => acc.data[off].max(v),
            ReduceKind::Min => acc.data[off].min(v),
        };
    }
    if kind == ReduceKind::Mean {
        acc = acc.map(|v| v / count as f64);
    }
    if !keepdim {
        acc.shape = (0..x.ndim())
            .filter(|i| !dims.contains(i))
            .map(|i| x.shape[i])
            .collect();
    }
    acc
}

fn sum_keep(x: &Arr, dim: usize) -> Arr {
    reduce(x, ReduceKind::Sum, &[dim], true, 1)
}

/// Sum `x` down to `shape` (which broadcasts to x's shape).
fn reduce_to_shape(x: &Arr, shape: &[usize]) -> Arr {
    let off = x.ndim() - shape.len();
    let mut out = Arr::full(shape, 0.0);
    for fl in 0..x.data.len() {
        let idx = unravel(fl, &x.shape);
        let o: Vec<usize> = (0..shape.len())
            .map(|j| if shape[j] == 1 { 0 } else { idx[j + off] })
            .collect();
        let p = out.offset(&o);
        out.data[p] += x.data[fl];
    }
    out
}

fn softmax(x: &Arr, dim: usize, log: bool) -> Arr {
    let m = reduce(x, ReduceKind::Max, &[dim], true, 1);
    let e = broadcast_zip(x, &m, |a, b| (a - b).exp());
    let s = sum_keep(&e, dim);
    if log {
        let lse = m
            .zip(&s, |a, b| a + b.ln())
            .unwrap_or_else(|e| panic!("{e}"));
        broadcast_zip(x, &lse, |a, b| a - b)
    } else {
        broadcast_zip(&e, &s, |a, b| a / b)
    }
}

fn permute(x: &Arr, perm: &[usize]) -> Arr {
    let shape: Vec<usize> = perm.iter().map(|&p| x.shape[p]).collect();
    let data = (0..numel(&shape))
        .map(|fl| {
            let o = unravel(fl, &shape);
            let mut i = vec![0; x.ndim()];
            for (k, &p) in perm.iter().enumerate() {
                i[p] = o[k];
            }
            x.at(&i)
        })
        .collect();
    Arr::new(shape, data)
}

/// The row of global id `id` in a piece of `rows` rows starting at global row `start`.
fn local_row(id: f64, start: usize, rows: usize) -> Option<usize> {
    (id as usize).checked_sub(start).filter(|&r| r < rows)
}

/// Rows of `w` (its rows start at global row `start`) at ids; zero rows for ids outside it.
fn embedding(ids: &Arr, w: &Arr, start: usize) -> Arr {
    let (v, d) = (w.shape[0], w.shape[1]);
    let mut shape = ids.shape.clone();
    shape.push(d);
    let data = ids
        .data
        .iter()
        .flat_map(|&id| {
            let row = local_row(id, start, v);
            (0..d).map(move |j| row.map_or(0.0, |r| w.data[r * d + j]))
        })
        .collect();
    Arr::new(shape, data)
}

/// Scatter-add of dy rows into the rows `out` (starting at global row `start`) holds.
fn embedding_backward(ids: &Arr, dy: &Arr, out: &[usize], start: usize) -> Arr {
    let (v, d) = (out[0], out[1]);
    let mut g = Arr::full(out, 0.0);
    for (r, &id) in ids.data.iter().enumerate() {
        if let Some(row) = local_row(id, start, v) {
            for j in 0..d {
                g.data[row * d + j] += dy.data[r * d + j];
            }
        }
    }
    g
}

const EPS: f64 = 1e-5;

/// Rows of the normalised block: (number of rows, row length).
fn rows(x: &Arr, k: usize) -> (usize, usize) {
    let len = numel(&x.shape[x.ndim() - k..]);
    (numel(&x.shape[..x.ndim() - k]), len)
}

/// Per row: (mean, 1 / sigma).
fn moments(row: &[f64]) -> (f64, f64) {
    let n = row.len() as f64;
    let mu = row.iter().sum::<f64>() / n;
    let var = row.iter().map(|v| (v - mu) * (v - mu)).sum::<f64>() / n;
    (mu, 1.0 / (var + EPS).sqrt())
}

/// (y, mean, rstd), the statistics with the normalised dims as 1.
fn layer_norm(x: &Arr, w: &Arr, b: &Arr, k: usize) -> Vec<Arr> {
    let (nr, len) = rows(x, k);
    let mut out = Vec::with_capacity(x.data.len());
    let (mut mean, mut rstd) = (Vec::with_capacity(nr), Vec::with_capacity(nr));
    for r in 0..nr {
        let row = &x.data[r * len..(r + 1) * len];
        let (mu, rs) = moments(row);
        out.extend(
            row.iter()
                .enumerate()
                .map(|(j, v)| (v - mu) * rs * w.data[j] + b.data[j]),
        );
        mean.push(mu);
        rstd.push(rs);
    }
    let stats: Vec<usize> = x
        .shape
        .iter()
        .enumerate()
        .map(|(i, &d)| if i < x.ndim() - k { d } else { 1 })
        .collect();
    vec![
        Arr::new(x.shape.clone(), out),
        Arr::new(stats.clone(), mean),
        Arr::new(stats, rstd),
    ]
}

/// dx from dy and the forward's per-row mean and rstd.
fn layer_norm_backward(x: &Arr, w: &Arr, dy: &Arr, (mean, rstd): (&Arr, &Arr), k: usize) -> Arr {
    let (nr, len) = rows(x, k);
    let mut dx = Vec::with_capacity(x.data.len());
    for r in 0..nr {
        let (mu, rs) = (mean.data[r], rstd.data[r]);
        let xh: Vec<f64> = x.data[r * len..(r + 1) * len]
            .iter()
            .map(|v| (v - mu) * rs)
            .collect();
        let g = &dy.data[r * len..(r + 1) * len];
        let dxh: Vec<f64> = (0..len).map(|j| g[j] * w.data[j]).collect();
        let m1 = dxh.iter().sum::<f64>() / len as f64;
        let m2 = dxh.iter().zip(&xh).map(|(a, b)| a * b).sum::<f64>() / len as f64;
        dx.extend((0..len).map(|j| rs * (dxh[j] - m1 - xh[j] * m2)));
    }
    Arr::new(x.shape.clone(), dx)
}

fn cross_entropy(logits: &Arr, labels: &Arr) -> Arr {
    let c = logits.shape[1];
    let data = labels
        .data
        .iter()
        .enumerate()
        .map(|(i, &y)| {
            let row = &logits.data[i * c..(i + 1) * c];
            let m = row.iter().cloned().fold(f64::NEG_INFINITY, f64::max);
            let lse = m + row.iter().map(|v| (v - m).exp()).sum::<f64>().ln();
            lse - row[y as usize]
        })
        .collect();
    Arr::new(labels.shape.clone(), data)
}

fn cross_entropy_backward(logits: &Arr, labels: &Arr, dloss: &Arr) -> Arr {
    let c = logits.shape[1];
    let mut out = Vec::with_capacity(logits.data.len());
    for (i, &y) in labels.data.iter().enumerate() {
        let row = &logits.data[i * c..(i + 1) * c];
        let m = row.iter().cloned().fold(f64::NEG_INFINITY, f64::max);
        let s: f64 = row.iter().map(|v| (v - m).exp()).sum();
        for (j, v) in row.iter().enumerate() {
            let onehot = if j == y as usize { 1.0 } else { 0.0 };
            out.push(((v - m).exp() / s - onehot) * dloss.data[i]);
        }
    }
    Arr::new(logits.shape.clone(), out)
}

/// The index of element `idx` of the indexed side on `dim`: one index per element (gather) or
/// per position along `dim` (index-select).
fn index_of(ids: &Arr, idx: &[usize], flat: usize, dim: usize, per_elem: bool) -> f64 {
    if per_elem {
        ids.data[flat]
    } else {
        ids.data[idx[dim]]
    }
}

/// `out[idx] = x[idx with dim -> id - start]` for ids inside x's rows (x's piece starts at
/// global position `start` on `dim`), 0 for the others; out has the indexed side's shape.
fn read_at(x: &Arr, ids: &Arr, dim: usize, per_elem: bool, start: usize) -> Arr {
    let mut shape = x.shape.clone();
    shape[dim] = if per_elem {
        ids.shape[dim]
    } else {
        ids.data.len()
    };
    let data = (0..numel(&shape))
        .map(|flat| {
            let mut idx = unravel(flat, &shape);
            let id = index_of(ids, &idx, flat, dim, per_elem);
            match local_row(id, start, x.shape[dim]) {
                Some(r) => {
                    idx[dim] = r;
                    x.at(&idx)
                }
                None => 0.0,
            }
        })
        .collect();
    Arr::new(shape, data)
}

/// Zeros of `out` (its piece starts at global position `start` on `dim`) plus each element of
/// src added at its index on `dim`, when that index is inside the piece.
fn add_at(ids: &Arr, src: &Arr, dim: usize, per_elem: bool, out: &[usize], start: usize) -> Arr {
    let mut g = Arr::full(out, 0.0);
    for flat in 0..src.data.len() {
        let mut idx = unravel(flat, &src.shape);
        let id = index_of(ids, &idx, flat, dim, per_elem);
        if let Some(r) = local_row(id, start, out[dim]) {
            idx[dim] = r;
            let o = g.offset(&idx);
            g.data[o] += src.data[flat];
        }
    }
    g
}
